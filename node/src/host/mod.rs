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
//! Calls may also be sent here directly (see [`sent`]): they wait in this host's
//! mailbox, run in batches the same way once no queued call waits, and are recorded
//! with their results in one `ActorCallsRan` — one commit per batch, no queue entry.
//! A state small enough for the record to hold ([`INLINE_STATE_BYTES`]) rides in
//! the batch's entry instead of being stored and copied as blobs.
//!
//! Talks to: consensus (reads the actors hosted here, proposes results), blobs
//! (state, inputs, outputs and their copies), peers (who holds what), the GPU
//! thread, the kernel cache.

mod sent;

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use gpumesh_consensus::{
    ActorState, AppliedEvent, CallRan, Command, ConsensusHandle, MergedOutput, Outcome, RequestId,
    INLINE_STATE_BYTES,
};
use gpumesh_protocol::changes::Base;
use gpumesh_protocol::{ActorCall, BlobId, BufferChanges, ShardChanges, StateBuffer};
use gpumesh_shaders::{Job, KernelCache};
use libp2p::PeerId;
use tokio::sync::{broadcast, mpsc, oneshot};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::blobs::BlobsHandle;
use crate::identity;
use crate::peers::PeersHandle;
use crate::timeline::{CallStage, Timeline};
use crate::wire::{Changes, NextState};
use crate::worker::GpuHandle;

pub(crate) use sent::{ask, CallAnswer, CallSender, SentCall};

/// Changes up to this size go to the backup inside the request; larger ones as a blob.
const INLINE_CHANGES: usize = 1 << 20;

/// Words of a state looked at to judge whether a call changed most of it.
const CHANGE_SAMPLES: usize = 1024;

/// Whether most of a state larger than [`INLINE_CHANGES`] changed, `after` against
/// `before` (`None`: zeros), judged from [`CHANGE_SAMPLES`] words spread evenly
/// over it: its backup then pulls the new state whole rather than the changes.
fn mostly_changed(before: &[Option<Arc<[u8]>>], after: &[Arc<[u8]>]) -> bool {
    let total: usize = after.iter().map(|a| a.len()).sum();
    if total <= INLINE_CHANGES {
        return false;
    }
    let step = (total / 4 / CHANGE_SAMPLES).max(1);
    let (mut looked, mut changed) = (0usize, 0usize);
    for (old, new) in before.iter().zip(after) {
        for at in (0..new.len() / 4).step_by(step).map(|w| 4 * w) {
            let was = old.as_ref().and_then(|o| o.get(at..at + 4));
            looked += 1;
            changed += usize::from(was.unwrap_or(&[0; 4]) != &new[at..at + 4]);
        }
    }
    2 * changed > looked
}

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
    /// Calls sent to this node as their actor's host.
    pub inbox: mpsc::Receiver<SentCall>,
    /// Where each sent call's time goes (`gpumesh bench actors`).
    pub timeline: Timeline,
}

/// The calls waiting for one actor hosted here (the oldest, at most [`MAX_BATCH`]),
/// with what running them needs.
struct Turn {
    name: String,
    /// Where the calls came from.
    source: Source,
    epoch: u32,
    /// The version of the state the calls run on.
    version: u64,
    /// Each call and the peer id of the node it came through.
    calls: Vec<(ActorCall, Option<PeerId>)>,
    state: Vec<ActorState>,
    /// The state's bytes when the record holds them (else empty).
    inline: Vec<Vec<u8>>,
    backup: Option<u64>,
    creator: String,
}

/// Where a turn's calls came from.
enum Source {
    /// The record's queue, from sequence number `first` on.
    Queued { first: u64 },
    /// This host's mailbox, answered on `replies`.
    Sent { replies: Vec<Waiting> },
}

/// A sent call's caller, waiting for its answer.
struct Waiting {
    request: RequestId,
    reply: oneshot::Sender<CallAnswer>,
    /// Batches it was in that the record did not take.
    tries: u32,
}

/// How many batches a sent call may be in that the record does not take before
/// it goes through the record's queue instead.
const MAX_TRIES: u32 = 3;

/// What a turn hands back to the host's loop: the state it left on the GPU when
/// recorded, and sent calls to run again in a later batch.
#[derive(Default)]
struct TurnEnd {
    state: Option<Vec<BlobId>>,
    again: Vec<SentCall>,
}

/// What a turn's calls left: how each ran (the first `ran.len()` of them; the
/// others could not run yet), the state after them, its bytes when the record is
/// to hold them, and the node keeping the second copy otherwise.
struct Batch {
    ran: Vec<CallRan>,
    state: Vec<(u32, BlobId)>,
    inline: Vec<Vec<u8>>,
    backup: u64,
}

impl Batch {
    /// How many of its calls ran (the others failed).
    fn done(&self) -> u64 {
        self.ran
            .iter()
            .filter(|r| matches!(r, CallRan::Done { .. }))
            .count() as u64
    }

    /// The state it left, when a call of it ran.
    fn after(&self) -> Option<Vec<BlobId>> {
        (self.done() > 0).then(|| self.state.iter().map(|(_, b)| *b).collect())
    }
}

/// What a chain of calls left: the state after the last, by binding in the
/// actor's order, and each call's own outputs.
struct Chained {
    state: Vec<Vec<u8>>,
    outputs: Vec<Vec<(u32, Vec<u8>)>>,
}

/// The most calls sent here that wait for one actor; beyond them a call is turned
/// away and waits in the record's queue instead, so a flood of calls cannot grow
/// the host's memory without bound.
const MAILBOX: usize = 1024;

/// Puts a sent call in its actor's mailbox, or turns it away when that is full.
fn post(mailbox: &mut HashMap<String, VecDeque<SentCall>>, call: SentCall) {
    let waiting = mailbox.entry(call.name.clone()).or_default();
    if waiting.len() >= MAILBOX {
        let _ = call.reply.send(CallAnswer::NotRun(format!(
            "{MAILBOX} calls to actor {} already wait on its host",
            call.name
        )));
    } else {
        waiting.push_back(call);
    }
}

/// Tells each sent call it was not recorded (its caller queues it instead).
fn not_run(replies: Vec<Waiting>, why: &str) {
    for w in replies {
        let _ = w.reply.send(CallAnswer::NotRun(why.to_string()));
    }
}

/// Actors whose GPU state may have to be freed: moved or deleted since the last
/// look (or all of them, after a snapshot or entries not seen). Looking at every
/// actor whose state is on the GPU after each entry cost each call as much as the
/// actors this node ever ran.
#[derive(Default)]
struct Gone {
    names: HashSet<String>,
    all: bool,
}

impl Gone {
    /// Whether `command` moves or deletes an actor whose state is on the GPU here.
    fn watched(&self, on_gpu: &HashMap<String, Vec<BlobId>>, command: &Command) -> bool {
        matches!(
            command,
            Command::PlaceActor { .. } | Command::DeleteActor { .. }
        ) && command.actor().is_some_and(|n| on_gpu.contains_key(n))
    }
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
    /// Runs each hosted actor's calls in order, one batch at a time per actor;
    /// different actors' calls run side by side (they meet only on the GPU thread).
    pub async fn run(mut self, cancel: CancellationToken) {
        let mut inbox = std::mem::replace(&mut self.inbox, mpsc::channel(1).1);
        let host = Arc::new(self);
        // Each applied entry (those waiting taken together) wakes the loop once: to
        // start the turns it made possible, and to free the GPU state of actors it
        // moved or deleted. (The event comes after the state it changed.)
        let mut events = host.consensus.subscribe();
        let mut gone = Gone::default();
        // The state each actor's last call here left on the GPU, by actor.
        let mut on_gpu: HashMap<String, Vec<BlobId>> = HashMap::new();
        // Calls sent here, by actor, oldest first.
        let mut mailbox: HashMap<String, VecDeque<SentCall>> = HashMap::new();
        // Actors with a batch under way here, and those batches.
        let mut busy: HashMap<tokio::task::Id, String> = HashMap::new();
        let mut running: JoinSet<TurnEnd> = JoinSet::new();
        loop {
            host.release_gone(&mut on_gpu, std::mem::take(&mut gone))
                .await;
            host.turn_away(&mut mailbox);
            for turn in host.turns(&mut mailbox, |name| busy.values().any(|n| n == name)) {
                let (host, name) = (host.clone(), turn.name.clone());
                let task = running.spawn(async move { host.turn(turn).await });
                busy.insert(task.id(), name);
            }
            tokio::select! {
                biased;
                _ = cancel.cancelled() => {
                    running.abort_all();
                    return;
                }
                Some(done) = running.join_next_with_id(), if !running.is_empty() => {
                    let (task, end) = match done {
                        Ok((task, end)) => (task, end),
                        Err(e) => (e.id(), TurnEnd::default()),
                    };
                    let Some(name) = busy.remove(&task) else { continue };
                    if let Some(state) = end.state {
                        on_gpu.insert(name.clone(), state);
                    }
                    let waiting = mailbox.entry(name).or_default();
                    for call in end.again.into_iter().rev() {
                        waiting.push_front(call);
                    }
                }
                Some(call) = inbox.recv() => {
                    host.timeline.mark_call(call.request, CallStage::AtHost);
                    post(&mut mailbox, call);
                    // Whatever else arrived meanwhile joins the same batch.
                    while let Ok(call) = inbox.try_recv() {
                        host.timeline.mark_call(call.request, CallStage::AtHost);
                        post(&mut mailbox, call);
                    }
                }
                event = events.recv() => {
                    for event in gpumesh_consensus::with_waiting(event, &mut events) {
                        match event {
                            Ok(AppliedEvent::Entry { entry, .. }) => {
                                if gone.watched(&on_gpu, &entry.command) {
                                    gone.names.extend(entry.command.actor().map(str::to_string));
                                }
                            }
                            // A snapshot, or entries not seen: look at them all.
                            Ok(AppliedEvent::Restored { .. })
                            | Err(broadcast::error::RecvError::Lagged(_)) => gone.all = true,
                            Err(broadcast::error::RecvError::Closed) => return,
                        }
                    }
                }
            }
        }
    }

    /// Runs one batch and records it; see [`TurnEnd`] for what comes back.
    async fn turn(&self, turn: Turn) -> TurnEnd {
        let sent: Vec<RequestId> = match &turn.source {
            Source::Sent { replies } if self.timeline.is_recording() => {
                replies.iter().map(|w| w.request).collect()
            }
            _ => Vec::new(),
        };
        for id in &sent {
            self.timeline.mark_call(*id, CallStage::Taken);
        }
        let batch = self.take(&turn).await;
        for id in &sent {
            self.timeline.mark_call(*id, CallStage::Ran);
        }
        let Turn {
            name,
            source,
            epoch,
            version,
            calls,
            ..
        } = turn;
        match source {
            Source::Queued { first } => TurnEnd {
                state: self
                    .record_queued(name, (epoch, version), first, batch)
                    .await,
                again: Vec::new(),
            },
            Source::Sent { replies } => {
                self.record_sent(name, (epoch, version), calls, replies, batch)
                    .await
            }
        }
    }

    /// Records a batch of queued calls; returns the state it left on the GPU when
    /// recorded. A batch that could not run yet, or whose report could not be
    /// made, is tried again after a pause.
    async fn record_queued(
        &self,
        name: String,
        (epoch, version): (u32, u64),
        first: u64,
        batch: std::result::Result<Batch, String>,
    ) -> Option<Vec<BlobId>> {
        let Ok(b) = batch else {
            tokio::time::sleep(RETRY).await;
            return None;
        };
        let (done, after) = (b.done(), b.after());
        let command = Command::ActorCallsDone {
            name: name.clone(),
            epoch,
            node: self.me,
            version,
            first,
            ran: b.ran,
            state: b.state,
            inline: b.inline,
            backup: b.backup,
        };
        match self.consensus.propose(command).await {
            Ok(c) if c.outcome == Outcome::Applied => {
                self.calls.inc_by(done);
                after
            }
            Ok(_) => None,
            Err(e) => {
                tracing::warn!(actor = %name, first, error = %e, "could not report the calls");
                tokio::time::sleep(RETRY).await;
                None
            }
        }
    }

    /// Records a batch of calls sent here and answers each. Calls the record did not
    /// take (a queued call came first, the state moved on) run again in a later
    /// batch while this node still hosts the actor and the record does not know
    /// their request ids; the others are answered [`CallAnswer::NotRun`].
    async fn record_sent(
        &self,
        name: String,
        (epoch, version): (u32, u64),
        calls: Vec<(ActorCall, Option<PeerId>)>,
        mut replies: Vec<Waiting>,
        batch: std::result::Result<Batch, String>,
    ) -> TurnEnd {
        let b = match batch {
            Ok(b) => b,
            Err(why) => {
                not_run(replies, &why);
                return TurnEnd::default();
            }
        };
        not_run(
            replies.split_off(b.ran.len()),
            "an input is not reachable from the host yet",
        );
        let (done, after) = (b.done(), b.after());
        let command = Command::ActorCallsRan {
            name: name.clone(),
            epoch,
            node: self.me,
            version,
            calls: replies.iter().map(|w| w.request).zip(b.ran).collect(),
            state: b.state,
            inline: b.inline,
            backup: b.backup,
        };
        let why = match self.consensus.propose(command).await {
            Ok(c) if c.outcome == Outcome::Applied => {
                self.calls.inc_by(done);
                for w in replies {
                    self.timeline.mark_call(w.request, CallStage::Recorded);
                    let answer = CallAnswer::recorded(&self.consensus, &name, w.request);
                    let _ = w.reply.send(answer);
                }
                return TurnEnd {
                    state: after,
                    again: Vec::new(),
                };
            }
            Ok(c) => match c.outcome {
                Outcome::Ignored(why) => why,
                // Refused outright: running it again would be refused again.
                other => {
                    let why = format!("the host's batch was refused: {other:?}");
                    not_run(replies, &why);
                    return TurnEnd::default();
                }
            },
            // Waited the proposal's whole deadline without a leader (this node is
            // cut off, or the mesh lost its quorum): another batch would wait as
            // long again. The calls go back to their callers at once.
            Err(e @ gpumesh_consensus::ConsensusError::NoLeader) => {
                not_run(replies, &format!("the host's batch was not recorded: {e}"));
                return TurnEnd::default();
            }
            Err(e) => e.to_string(),
        };
        tracing::debug!(actor = %name, %why, "a batch of sent calls was not recorded");
        let (me, n) = (self.me, name.clone());
        let ids: Vec<RequestId> = replies.iter().map(|w| w.request).collect();
        let (hosted, known): (bool, Vec<bool>) = self.consensus.read_local(move |s| {
            let hosted = s
                .actor(&n)
                .is_some_and(|a| a.host == Some(me) && a.epoch == epoch);
            (hosted, ids.iter().map(|id| s.prior(id).is_some()).collect())
        });
        let mut again = Vec::new();
        for (((call, caller), w), known) in calls.into_iter().zip(replies).zip(known) {
            if hosted && !known && w.tries < MAX_TRIES {
                again.push(SentCall {
                    name: name.clone(),
                    call,
                    request: w.request,
                    caller: caller.unwrap_or_else(|| self.peers.me()),
                    reply: w.reply,
                    tries: w.tries + 1,
                });
            } else {
                let _ = w.reply.send(CallAnswer::NotRun(format!(
                    "the host's batch was not recorded: {why}"
                )));
            }
        }
        TurnEnd { state: None, again }
    }

    /// Answers the calls sent here for actors this node no longer hosts (deleted,
    /// moved, never here): their callers queue them in the record.
    fn turn_away(&self, mailbox: &mut HashMap<String, VecDeque<SentCall>>) {
        mailbox.retain(|_, calls| !calls.is_empty());
        if mailbox.is_empty() {
            return;
        }
        let me = self.me;
        let names: Vec<String> = mailbox.keys().cloned().collect();
        let hosted: HashSet<String> = self.consensus.read_local(move |s| {
            names
                .into_iter()
                .filter(|n| s.actor(n).is_some_and(|a| a.host == Some(me)))
                .collect()
        });
        mailbox.retain(|name, calls| {
            if hosted.contains(name) {
                return true;
            }
            for call in calls.drain(..) {
                let _ = call.reply.send(CallAnswer::NotRun(format!(
                    "node {me:x} does not host actor {name}"
                )));
            }
            false
        });
    }

    /// Frees the GPU buffers of actors no longer hosted here (deleted, or moved to
    /// another node), among those `maybe` names.
    async fn release_gone(&self, on_gpu: &mut HashMap<String, Vec<BlobId>>, maybe: Gone) {
        if on_gpu.is_empty() || (!maybe.all && maybe.names.is_empty()) {
            return;
        }
        let me = self.me;
        let gone: Vec<String> = self.consensus.read_local(|s| {
            let hosted_elsewhere = |n: &&String| s.actor(n).is_none_or(|a| a.host != Some(me));
            if maybe.all {
                on_gpu.keys().filter(hosted_elsewhere).cloned().collect()
            } else {
                maybe
                    .names
                    .iter()
                    .filter(|n| on_gpu.contains_key(*n))
                    .filter(hosted_elsewhere)
                    .cloned()
                    .collect()
            }
        });
        for name in gone {
            let blobs = on_gpu.remove(&name).unwrap_or_default();
            tracing::debug!(actor = %name, "no longer hosted here; its GPU buffers are freed");
            self.gpu.forget(blobs).await;
        }
    }

    /// The next batch of every actor hosted here under its current epoch that has
    /// none under way (`busy`): its queued calls if any wait in the record, else
    /// the calls sent here (taken out of `mailbox`).
    fn turns(
        &self,
        mailbox: &mut HashMap<String, VecDeque<SentCall>>,
        busy: impl Fn(&str) -> bool,
    ) -> Vec<Turn> {
        let me = self.me;
        let sent: BTreeSet<&String> = mailbox
            .iter()
            .filter(|(name, calls)| !calls.is_empty() && !busy(name))
            .map(|(name, _)| name)
            .collect();
        let mut turns: Vec<Turn> = self.consensus.read_local(|s| {
            // The actors with calls queued in the record, and those with calls sent
            // here: not every actor in the record.
            let queued: BTreeSet<&String> = s
                .actors_with_queued_calls()
                .filter(|a| a.host == Some(me))
                .map(|a| &a.name)
                .collect();
            queued
                .union(&sent)
                .filter_map(|name| s.actor(name))
                .filter(|a| a.host == Some(me) && !busy(&a.name))
                .filter_map(|a| {
                    let source = match a.next_call() {
                        Some((first, _)) => Source::Queued { first },
                        None if sent.contains(&&a.name) => Source::Sent {
                            replies: Vec::new(),
                        },
                        None => return None,
                    };
                    let calls = match source {
                        Source::Queued { first } => (first..)
                            .map_while(|seq| a.pending.get(&seq))
                            .take(MAX_BATCH)
                            .map(|p| (p.call.clone(), p.caller.parse().ok()))
                            .collect(),
                        Source::Sent { .. } => Vec::new(),
                    };
                    Some(Turn {
                        name: a.name.clone(),
                        source,
                        epoch: a.epoch,
                        version: a.version,
                        calls,
                        state: a.state.clone(),
                        inline: a.inline.clone(),
                        backup: a.backup,
                        creator: a.creator.clone(),
                    })
                })
                .collect()
        });
        for turn in &mut turns {
            let Source::Sent { replies, .. } = &mut turn.source else {
                continue;
            };
            let Some(waiting) = mailbox.get_mut(&turn.name) else {
                continue;
            };
            let n = waiting.len().min(MAX_BATCH);
            for call in waiting.drain(..n) {
                turn.calls.push((call.call, Some(call.caller)));
                replies.push(Waiting {
                    request: call.request,
                    reply: call.reply,
                    tries: call.tries,
                });
            }
        }
        turns
    }

    /// Runs a turn's calls one after another, each on the state the one before left;
    /// keeps the final state (in the batch when the record holds it, else here and
    /// on a second node) and the outputs on two nodes; why not, when the first
    /// cannot run yet. When the state, or the first call's input, is on no node this
    /// one can reach (every member asked, for several rounds), those calls fail with
    /// that reason instead, the state as it was, rather than wait for ever.
    async fn take(&self, t: &Turn) -> std::result::Result<Batch, String> {
        // The state's bytes: in the record, or from the node that keeps its copy
        // or its creator; the calls' inputs, from the nodes they came through.
        let holder = t
            .backup
            .and_then(|b| self.peers.peer(b))
            .or_else(|| t.creator.parse().ok());
        let in_record = |i: usize| t.inline.get(i).map(|b| Arc::<[u8]>::from(b.as_slice()));
        for (i, s) in t.state.iter().enumerate() {
            let Some(blob) = s.blob else { continue };
            if in_record(i).is_some() {
                continue;
            }
            if let Err(e) = self.blobs.fetch(blob, holder).await {
                // Every member was asked, for several rounds: the calls fail, and
                // the state stays as it was for the calls made once a node that
                // holds it is back.
                tracing::warn!(actor = %t.name, error = %e, "the actor's state is not reachable");
                let why = format!(
                    "actor {}'s state (version {}) is on no node its host could reach: \
                     blob {blob}: {e}",
                    t.name, t.version
                );
                return Ok(self.none_ran(t, t.calls.len(), &why));
            }
        }
        let mut calls = Vec::new();
        for (call, from) in &t.calls {
            let mut unreachable = None;
            for blob in call.bindings.iter().filter_map(|b| b.role.blob()) {
                if let Err(e) = self.blobs.fetch(blob, *from).await {
                    tracing::warn!(actor = %t.name, error = %e, "a call input is not reachable");
                    unreachable = Some(format!(
                        "input blob {blob} is on no node the host could reach: {e}"
                    ));
                    break;
                }
            }
            match unreachable {
                None => calls.push((call, *from)),
                // The calls before it run now; it fails alone when it comes first,
                // so the calls after it do not wait behind it for ever.
                Some(_) if !calls.is_empty() => break,
                Some(why) => return Ok(self.none_ran(t, 1, &why)),
            }
        }
        if calls.is_empty() {
            return Err("no call to run".into());
        }
        let store = self.blobs.store().clone();
        let base: Vec<Option<Arc<[u8]>>> = t
            .state
            .iter()
            .enumerate()
            .map(|(i, s)| {
                in_record(i).or_else(|| s.blob.and_then(|b| store.get_shared(&b).ok().flatten()))
            })
            .collect();
        if t.state
            .iter()
            .zip(&base)
            .any(|(s, b)| s.blob.is_some() && b.is_none())
        {
            // Fetched above, gone since: the next turn fetches it again.
            return Err(format!(
                "actor {}'s state went from its host's disk",
                t.name
            ));
        }
        // Each call starts from what the one before left.
        let mut now: Vec<(StateBuffer, Option<BlobId>)> =
            t.state.iter().map(|s| (s.buffer, s.blob)).collect();
        let mut latest: HashMap<BlobId, Arc<[u8]>> = t
            .state
            .iter()
            .zip(&base)
            .filter_map(|(s, b)| Some((s.blob?, b.clone()?)))
            .collect();
        let mut ran = Vec::new();
        let mut outputs: Vec<Vec<(u32, Vec<u8>)>> = Vec::new();
        // Several calls run as one chain on the GPU when they can (no readback
        // between them); else, or when the chain fails (to find which call fails),
        // one at a time.
        let mut one_by_one = &calls[..];
        if calls.len() > 1 {
            if let Some(chain) = self.run_chain(&calls, &now, &latest).await {
                latest.clear();
                for ((_, blob), bytes) in now.iter_mut().zip(chain.state) {
                    let id = BlobId::of(&bytes);
                    *blob = Some(id);
                    latest.insert(id, Arc::from(bytes));
                }
                for own in chain.outputs {
                    ran.push(CallRan::Done {
                        outputs: Vec::new(),
                    });
                    outputs.push(own);
                }
                one_by_one = &[];
            }
        }
        for (call, _) in one_by_one {
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
            return Err("the host's GPU could not run the call yet".into());
        }
        let changed = ran.iter().any(|r| matches!(r, CallRan::Done { .. }));
        let small = t.state.iter().map(|s| s.buffer.size).sum::<u64>() <= INLINE_STATE_BYTES;
        let mut backup = t.backup.unwrap_or(self.me);
        let mut inline = Vec::new();
        if changed && small {
            for (_, blob) in &now {
                let bytes = blob.and_then(|b| latest.get(&b));
                // A changed state's every buffer has its bytes here.
                inline.push(bytes.ok_or("the new state's bytes are missing")?.to_vec());
            }
        } else if changed {
            backup = self
                .keep_state(&t.name, t.backup, &t.state, &base, &now, &latest)
                .await
                .ok_or_else(|| {
                    format!(
                        "actor {}'s new state could not be kept on a second node",
                        t.name
                    )
                })?;
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
                        return Err(format!("a call's output could not be kept: {e}"));
                    }
                }
            }
        }
        Ok(Batch {
            ran,
            state: now
                .iter()
                .filter_map(|(s, blob)| Some((s.binding, (*blob)?)))
                .collect(),
            inline,
            backup,
        })
    }

    /// A batch in which the first `n` calls of `t` failed for `why`, leaving the
    /// state as it was.
    fn none_ran(&self, t: &Turn, n: usize, why: &str) -> Batch {
        Batch {
            ran: vec![
                CallRan::Failed {
                    reason: why.to_string()
                };
                n
            ],
            state: t
                .state
                .iter()
                .filter_map(|s| Some((s.buffer.binding, s.blob?)))
                .collect(),
            inline: Vec::new(),
            backup: t.backup.unwrap_or(self.me),
        }
    }

    /// The job a call runs as on the state `now` (bytes of a state not yet stored
    /// are in `latest`), its state buffers kept on the GPU after it; or why the call
    /// cannot run (its kernel, or the call, does not fit).
    fn call_job(
        &self,
        call: &ActorCall,
        now: &[(StateBuffer, Option<BlobId>)],
        latest: &HashMap<BlobId, Arc<[u8]>>,
    ) -> Result<Job, String> {
        let spec = call.as_task(now);
        let kernel = self
            .kernels
            .get(&spec.shader, &spec.entry_point)
            .map_err(|e| e.to_string())?;
        let store = self.blobs.store().clone();
        Job::new(spec, kernel, |id| {
            latest
                .get(id)
                .cloned()
                .or_else(|| store.get_shared(id).ok().flatten())
        })
        .and_then(|j| j.keep_resident(now.iter().map(|(s, _)| s.binding)))
        .map_err(|e| e.to_string())
    }

    /// How long a call may run on the GPU.
    fn deadline_of(&self, call: &ActorCall) -> Duration {
        call.deadline_ms
            .map_or(self.default_deadline, Duration::from_millis)
    }

    /// Runs `calls` as one chain on the state `now` (bytes of a state not yet
    /// stored are in `latest`): the state after the last and each call's own
    /// outputs, or `None` when they cannot run chained or the chain failed.
    async fn run_chain(
        &self,
        calls: &[(&ActorCall, Option<PeerId>)],
        now: &[(StateBuffer, Option<BlobId>)],
        latest: &HashMap<BlobId, Arc<[u8]>>,
    ) -> Option<Chained> {
        let state_bindings: Vec<u32> = now.iter().map(|(s, _)| s.binding).collect();
        let mut jobs = Vec::with_capacity(calls.len());
        let mut deadline = Duration::MAX;
        for (call, _) in calls {
            jobs.push(self.call_job(call, now, latest).ok()?);
            // The shortest: no call is let go on past its own deadline in the chain
            // (one that takes longer fails the chain, and each then runs alone under
            // its own), as the tasks' batches do. With the longest, a runaway with a
            // short deadline among calls with the default ran on for the default
            // (minutes) on GPUs that run loops as written.
            deadline = deadline.min(self.deadline_of(call));
        }
        let chain = match self
            .gpu
            .run_chain(jobs, state_bindings.clone(), Some(deadline))
            .await
        {
            Ok(chain) => chain,
            Err(e) => {
                tracing::debug!(error = %e, "a chain of calls failed; running them one at a time");
                return None;
            }
        };
        let mut carried = chain.carried;
        let state = state_bindings
            .iter()
            .map(|b| carried.remove(b))
            .collect::<Option<Vec<_>>>()?;
        let outputs = chain
            .outputs
            .into_iter()
            .map(|own| own.into_iter().collect())
            .collect();
        Some(Chained { state, outputs })
    }

    /// Runs one call on the state `now` (bytes of a state not yet stored are in
    /// `latest`).
    async fn run_call(
        &self,
        call: &ActorCall,
        now: &[(StateBuffer, Option<BlobId>)],
        latest: &HashMap<BlobId, Arc<[u8]>>,
    ) -> Result<Ran, CallError> {
        let state_bindings: Vec<u32> = now.iter().map(|(s, _)| s.binding).collect();
        let job = self
            .call_job(call, now, latest)
            .map_err(CallError::Failed)?;
        let out = self
            .gpu
            .run(job.clone(), 0, Some(self.deadline_of(call)))
            .await
            .map_err(|e| CallError::Failed(e.to_string()))?;
        let bytes: u64 = now.iter().map(|(s, _)| s.size).sum::<u64>()
            + call.bindings.iter().map(|b| b.role.size()).sum::<u64>();
        let finish = move || {
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
        };
        if bytes <= crate::outputs::MERGE_IN_PLACE_BYTES {
            return finish();
        }
        tokio::task::spawn_blocking(finish)
            .await
            .map_err(|_| CallError::NotYet)?
    }

    /// Stores the state a batch left (`now`, bytes in `latest`) here, while the node
    /// that keeps the second copy (`backup` if it can) makes the same from the state
    /// it holds (`old`, bytes `base`) and what changed between the two (only that
    /// travels), or, where the batch changed most of a large state, pulls the new
    /// state whole; returns that node. `None` when either could not be made.
    ///
    /// Why whole: the changes of a call that rewrites every word are as large as the
    /// state, and made from it, they cost the host a diff and a hash of it, and the
    /// backup a copy of its base, the changes written over it and a hash, before its
    /// write. Pulled whole, the state is hashed and written as it arrives. A call
    /// rewriting a 16 MiB state (`gpumesh bench actors --state-kib 16384`, A/B
    /// alternating, three rounds) took 65-97 ms at the p50 against 108-115 ms.
    async fn keep_state(
        &self,
        name: &str,
        backup: Option<u64>,
        old: &[ActorState],
        base: &[Option<Arc<[u8]>>],
        now: &[(StateBuffer, Option<BlobId>)],
        latest: &HashMap<BlobId, Arc<[u8]>>,
    ) -> Option<u64> {
        // Each buffer's new bytes, and their id (hashed as they were read back).
        let mut bytes = Vec::with_capacity(now.len());
        let mut ids = Vec::with_capacity(now.len());
        for (_, blob) in now {
            bytes.push(latest.get(&(*blob)?)?.clone());
            ids.push((*blob)?);
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
        // Most of a large state rewritten: the backup pulls each new buffer whole,
        // served from memory here (staged) while it does.
        let (changes, _staged) = if mostly_changed(base, &bytes) {
            let store = self.blobs.store();
            let staged = ids
                .iter()
                .zip(&bytes)
                .map(|(id, b)| store.stage(*id, b.clone()))
                .collect();
            (Changes::Whole, staged)
        } else {
            self.changes_made(now, base, &bytes).await?
        };
        let prefer = backup.and_then(|b| self.peers.peer(b));
        let store = self.blobs.store().clone();
        // This node's copy is written while the backup makes its own.
        let own = tokio::task::spawn_blocking(move || {
            ids.iter().zip(bytes).try_for_each(|(id, b)| {
                store.put_hashed(*id, &b)?;
                // The next call starts from it.
                store.remember(*id, b);
                Ok::<_, crate::error::NodeError>(())
            })
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

    /// What a batch changed in each state buffer (`after` against `base`), as the
    /// backup is sent it: in the request when small; else as a blob the backup
    /// pulls from here, served from memory (staged, the guard returned) while it
    /// does. The changes are for the backup alone, and the call is not recorded
    /// before it has its copy, so they need no copy on this disk (a file written and
    /// synced, then removed).
    async fn changes_made(
        &self,
        now: &[(StateBuffer, Option<BlobId>)],
        base: &[Option<Arc<[u8]>>],
        after: &[Arc<[u8]>],
    ) -> Option<(Changes, Vec<crate::blobs::store::Staged>)> {
        let (base, after) = (base.to_vec(), after.to_vec());
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
        if encoded.len() <= INLINE_CHANGES {
            return Some((Changes::Inline(encoded), Vec::new()));
        }
        let encoded = Arc::new(encoded);
        let bytes = encoded.clone();
        let id = tokio::task::spawn_blocking(move || BlobId::of(&bytes))
            .await
            .ok()?;
        let staged = self.blobs.store().stage(id, encoded);
        Some((Changes::Blob(id), vec![staged]))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use gpumesh_protocol::{Grid, ShaderSource};

    use super::*;

    fn sent(name: &str, n: u64) -> (SentCall, oneshot::Receiver<CallAnswer>) {
        let (reply, answer) = oneshot::channel();
        let call = SentCall {
            name: name.into(),
            call: ActorCall {
                shader: ShaderSource::Wgsl(String::new()),
                entry_point: "main".into(),
                bindings: vec![],
                grid: Grid([1, 1, 1]),
                deadline_ms: None,
            },
            request: RequestId::new(1, n),
            caller: PeerId::random(),
            reply,
            tries: 0,
        };
        (call, answer)
    }

    #[test]
    fn a_large_state_mostly_rewritten_is_sent_whole_and_one_barely_touched_is_not() {
        let big = 4usize << 20;
        let zeros: Arc<[u8]> = vec![0u8; big].into();
        let ones: Arc<[u8]> = vec![1u8; big].into();
        let mut touched = vec![0u8; big];
        for at in [0, big / 3, big / 2, big - 4] {
            touched[at] = 7;
        }
        let touched: Arc<[u8]> = touched.into();
        // A state never written is zeros.
        assert!(mostly_changed(&[None], std::slice::from_ref(&ones)));
        assert!(!mostly_changed(&[None], std::slice::from_ref(&zeros)));
        assert!(mostly_changed(
            &[Some(zeros.clone())],
            std::slice::from_ref(&ones)
        ));
        assert!(!mostly_changed(&[Some(zeros.clone())], &[touched]));
        // Two buffers, one rewritten and one not: half is not most.
        let both = [Some(zeros.clone()), Some(zeros.clone())];
        assert!(!mostly_changed(&both, &[ones.clone(), zeros.clone()]));
        assert!(mostly_changed(&both, &[ones.clone(), ones.clone()]));
        // Up to the inline bound the changes go in the request, however many.
        let small: Arc<[u8]> = vec![1u8; INLINE_CHANGES].into();
        assert!(!mostly_changed(&[None], &[small]));
    }

    #[test]
    fn a_full_mailbox_turns_a_call_away_to_the_queue_and_others_still_fit() {
        let mut mailbox = HashMap::new();
        let mut answers = Vec::new();
        for n in 0..MAILBOX as u64 {
            let (call, answer) = sent("a", n);
            post(&mut mailbox, call);
            answers.push(answer);
        }
        let (over, mut answer) = sent("a", u64::MAX);
        post(&mut mailbox, over);
        match answer.try_recv().unwrap() {
            CallAnswer::NotRun(why) => assert!(why.contains("already wait"), "{why}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(mailbox["a"].len(), MAILBOX);
        // Another actor's calls are not held back by this one's.
        let (other, mut answer) = sent("b", 0);
        post(&mut mailbox, other);
        assert!(answer.try_recv().is_err(), "waiting, not answered");
        assert_eq!(mailbox["b"].len(), 1);
        // Those waiting were not answered.
        assert!(answers.iter_mut().all(|a| a.try_recv().is_err()));
    }
}
