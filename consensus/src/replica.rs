//! The consensus actor: owns the raft-rs `RawNode`, its [`RedbStorage`] and the
//! [`StateMachine`]; talks to peers only through a [`Transport`], and to the rest
//! of the node through a [`ConsensusHandle`].
//!
//! One loop: tick on a timer, step messages from peers, collect proposals, then
//! handle every Ready in the order raft-rs documents — send the leader's messages
//! at once (a leader may replicate before its own fsync, Raft thesis §10.2.1),
//! persist snapshot + entries + hard state in one durable redb transaction, apply
//! committed entries, and only then send the messages that depend on the persisted
//! state (votes, append responses). Then `advance`, and the same for the LightReady.
//!
//! Proposals are idempotent by request id. A proposal made on a follower is
//! forwarded to the leader; the proposer learns the outcome when its own replica
//! applies the entry, so no reply has to survive a leader change. The leader tells
//! the proposer where it appended the entry (index, term): if a different entry
//! commits at that index, the proposal certainly failed; if nothing can be told
//! before the deadline, the proposer gets [`ConsensusError::OutcomeUnknown`] and a
//! retry with the same request id is safe.
//!
//! Linearizable reads use Raft's ReadIndex, batched as in etcd: one request is in
//! flight per replica and covers every read that arrived before it was sent. raft-rs
//! drops a ReadIndex silently when no leader is known, when the leader has not yet
//! committed an entry in its term, or when the message is lost, so a request is only
//! sent once this replica has seen a commit in the current term, and is sent again
//! (with a fresh context) when the leader changes or no answer came within a few
//! heartbeats. Contexts carry the replica id and a never-reused sequence number:
//! the leader ignores a context it already holds, and a restarted replica must not
//! take an old answer for a new read.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpumesh_protocol::{codec, NodeCapability};
use protobuf::Message as _;
use raft::eraftpb::{
    ConfChange, ConfChangeType, ConfState, Entry, EntryType, Message as RaftMessage, MessageType,
    Snapshot,
};
use raft::{RawNode, StateRole};
use tokio::sync::{broadcast, mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::{self, Instant, MissedTickBehavior};
use tracing::{debug, error, info, warn};

use crate::cluster::ClusterId;
use crate::command::{Command, Committed, LogEntry, Outcome, RequestId, RequestIds};
use crate::error::{ConsensusError, Result};
use crate::state::{Applied, StateMachine};
use crate::storage::RedbStorage;
use crate::tracing_drain::raft_logger;
use crate::transport::Transport;
use crate::wire::{decode_raft, encode_raft, Frame, FrameBody};

/// Tuning of one replica. The defaults suit a LAN mesh; tests shrink the tick.
#[derive(Clone, Debug)]
pub struct ReplicaConfig {
    /// This replica's raft id (non-zero).
    pub id: u64,
    /// One Raft tick.
    pub tick_interval: Duration,
    /// Ticks without a leader before a follower campaigns.
    pub election_tick: usize,
    /// Ticks between leader heartbeats.
    pub heartbeat_tick: usize,
    /// Take a snapshot and compact the log after this many applied entries.
    pub snapshot_interval: u64,
    /// Entries kept in the log behind a snapshot, so a follower that lags a little
    /// catches up from the log rather than a full snapshot.
    pub log_retain: u64,
    /// How long a proposal may take before its caller gets an answer anyway.
    pub proposal_timeout: Duration,
    /// How long a linearizable read may wait for a quorum.
    pub read_timeout: Duration,
    /// Leader-side: promote caught-up learners while voters are below the cap.
    pub auto_promote: bool,
    /// Capacity of the actor's inbox.
    pub inbox_capacity: usize,
    /// Capacity of the applied-event broadcast (slow subscribers see `Lagged`).
    pub event_capacity: usize,
}

impl ReplicaConfig {
    pub fn new(id: u64) -> Self {
        Self {
            id,
            tick_interval: Duration::from_millis(100),
            election_tick: 10,
            heartbeat_tick: 2,
            snapshot_interval: 10_000,
            log_retain: 1_000,
            proposal_timeout: Duration::from_secs(10),
            read_timeout: Duration::from_secs(5),
            auto_promote: true,
            inbox_capacity: 8192,
            event_capacity: 8192,
        }
    }

    fn raft_config(&self, applied: u64) -> raft::Config {
        raft::Config {
            id: self.id,
            election_tick: self.election_tick,
            heartbeat_tick: self.heartbeat_tick,
            applied,
            max_size_per_msg: 1 << 20,
            max_inflight_msgs: 256,
            // A leader cut off from a quorum steps down, and a partitioned node does
            // not disrupt the group with higher terms when it returns.
            check_quorum: true,
            pre_vote: true,
            // Off: raft-rs 0.7's append batching can merge new entries into an
            // already queued empty MsgAppend whose prev index is the first new entry,
            // producing an append whose follower acknowledges one entry more than it
            // stored (found by the randomized test: "to_commit out of range").
            // Proposals are batched before they reach Raft instead.
            batch_append: false,
            ..Default::default()
        }
    }
}

/// The Raft role of a replica.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RaftRole {
    Follower,
    Candidate,
    PreCandidate,
    Leader,
}

impl From<StateRole> for RaftRole {
    fn from(r: StateRole) -> Self {
        match r {
            StateRole::Follower => RaftRole::Follower,
            StateRole::Candidate => RaftRole::Candidate,
            StateRole::PreCandidate => RaftRole::PreCandidate,
            StateRole::Leader => RaftRole::Leader,
        }
    }
}

/// A replica's view of the group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Status {
    pub id: u64,
    pub role: RaftRole,
    /// The leader this replica follows (0 if none is known).
    pub leader_id: u64,
    pub term: u64,
    pub commit_index: u64,
    pub applied_index: u64,
    pub first_index: u64,
    pub last_index: u64,
    pub snapshot_index: u64,
    pub voters: Vec<u64>,
    pub learners: Vec<u64>,
    pub pending_proposals: usize,
    /// How many times, since this replica started, the leader it knows became a
    /// different node (the first leader it learns of counts; "no leader" during an
    /// election does not).
    pub leader_changes: u64,
}

/// How the proposals made through one replica's handles ended, counted as each
/// proposer got its answer. A proposal forwarded to the leader counts on the replica
/// whose client made it, not on the leader.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProposalCounts {
    /// Committed and took effect ([`Outcome::Applied`], `TaskSubmitted`,
    /// `ShardAssigned`).
    pub applied: u64,
    /// Committed without effect ([`Outcome::Ignored`]: a stale epoch, a late result).
    pub ignored: u64,
    /// Committed and refused by the state machine ([`Outcome::Rejected`]).
    pub rejected: u64,
    /// Certainly not committed: no leader, dropped by a new leader, the actor stopped.
    pub dropped: u64,
    /// Perhaps committed, perhaps not ([`ConsensusError::OutcomeUnknown`]).
    pub unknown: u64,
}

/// The shared, atomically counted form of [`ProposalCounts`].
#[derive(Debug, Default)]
struct ProposalTally {
    applied: AtomicU64,
    ignored: AtomicU64,
    rejected: AtomicU64,
    dropped: AtomicU64,
    unknown: AtomicU64,
}

impl ProposalTally {
    fn count(&self, answer: &Result<Committed>) {
        let counter = match answer {
            Ok(c) => match c.outcome {
                Outcome::Ignored(_) => &self.ignored,
                Outcome::Rejected(_) => &self.rejected,
                Outcome::Applied
                | Outcome::TaskSubmitted { .. }
                | Outcome::ShardAssigned { .. } => &self.applied,
            },
            Err(ConsensusError::OutcomeUnknown { .. }) => &self.unknown,
            Err(_) => &self.dropped,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn counts(&self) -> ProposalCounts {
        ProposalCounts {
            applied: self.applied.load(Ordering::Relaxed),
            ignored: self.ignored.load(Ordering::Relaxed),
            rejected: self.rejected.load(Ordering::Relaxed),
            dropped: self.dropped.load(Ordering::Relaxed),
            unknown: self.unknown.load(Ordering::Relaxed),
        }
    }
}

/// Something the state machine did, in log order.
#[derive(Clone, Debug)]
pub enum AppliedEvent {
    /// A committed entry was applied (`duplicate`: its request id had been applied
    /// before, so it had no effect and `committed` repeats the first outcome).
    Entry {
        index: u64,
        term: u64,
        entry: Arc<LogEntry>,
        committed: Committed,
        duplicate: bool,
    },
    /// The state was replaced by a snapshot taken at `index`.
    Restored { index: u64, term: u64 },
}

type Reply<T> = oneshot::Sender<Result<T>>;
type ReadFn = Box<dyn FnOnce(Result<&StateMachine>) + Send>;

enum Msg {
    Propose {
        entry: LogEntry,
        respond_to: Reply<Committed>,
    },
    Receive {
        from: u64,
        frame: Vec<u8>,
    },
    ReadLocal {
        read: ReadFn,
    },
    ReadLinearizable {
        read: ReadFn,
    },
    Status {
        respond_to: oneshot::Sender<Status>,
    },
    Campaign {
        respond_to: Reply<()>,
    },
    TransferLeader {
        to: u64,
    },
    PeerUnreachable {
        id: u64,
    },
    Shutdown {
        respond_to: oneshot::Sender<()>,
    },
}

/// A cheap, cloneable client of one replica.
#[derive(Clone)]
pub struct ConsensusHandle {
    id: u64,
    tx: mpsc::Sender<Msg>,
    events: broadcast::Sender<AppliedEvent>,
    status: watch::Receiver<Status>,
    ids: Arc<RequestIds>,
    proposals: Arc<ProposalTally>,
    task: Arc<Mutex<Option<JoinHandle<()>>>>,
}

impl std::fmt::Debug for ConsensusHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsensusHandle")
            .field("id", &self.id)
            .finish()
    }
}

impl ConsensusHandle {
    /// Starts the replica's actor on the current tokio runtime.
    ///
    /// `storage` either holds a Raft state (initialised here with
    /// [`RedbStorage::initialize`], or from an earlier run), or is empty: then the
    /// replica waits to be added by an existing member and receives a snapshot.
    pub fn start(
        config: ReplicaConfig,
        storage: RedbStorage,
        transport: Arc<dyn Transport>,
    ) -> Result<Self> {
        if config.id == 0 {
            return Err(ConsensusError::Invalid("raft id 0 is reserved".into()));
        }
        let snapshot_meta = storage.snapshot_metadata().clone();
        let state = storage.snapshot_state()?;
        let cluster = storage.cluster_id();
        let raft_config = config.raft_config(snapshot_meta.index);
        raft_config.validate()?;
        let raw = RawNode::new(&raft_config, storage, &raft_logger(config.id))?;

        let (tx, inbox) = mpsc::channel(config.inbox_capacity.max(16));
        let (events, _) = broadcast::channel(config.event_capacity.max(16));
        let ids = Arc::new(RequestIds::new(config.id));
        let mut actor = Actor {
            cluster,
            raw,
            state,
            conf_state: snapshot_meta.get_conf_state().clone(),
            transport,
            inbox,
            events: events.clone(),
            status_tx: None,
            pending: BTreeMap::new(),
            placed_at: BTreeMap::new(),
            batch: Vec::new(),
            reads: BTreeMap::new(),
            read_requests: BTreeMap::new(),
            read_sent: None,
            confirmed_reads: Vec::new(),
            next_read: 0,
            ids: ids.clone(),
            ticks: 0,
            last_leader: 0,
            known_leader: 0,
            leader_changes: 0,
            cfg: config.clone(),
        };
        let (status_tx, status) = watch::channel(actor.status());
        actor.status_tx = Some(status_tx);
        info!(
            raft_id = config.id,
            %cluster,
            snapshot_index = snapshot_meta.index,
            last_index = actor.raw.store().last(),
            "consensus replica starting"
        );
        let task = tokio::spawn(actor.run());
        Ok(Self {
            id: config.id,
            tx,
            events,
            status,
            ids,
            proposals: Arc::default(),
            task: Arc::new(Mutex::new(Some(task))),
        })
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    /// A request id no other proposal of this replica uses.
    pub fn new_request_id(&self) -> RequestId {
        self.ids.next_id()
    }

    /// Proposes `command` under a fresh request id and waits until it is applied
    /// here (so a read on this replica afterwards sees it).
    pub async fn propose(&self, command: Command) -> Result<Committed> {
        self.propose_with_id(self.new_request_id(), command).await
    }

    /// Proposes `command` under `request_id`. Retrying with the same id after an
    /// error is always safe: the command is applied at most once and a retry of an
    /// applied request returns the first outcome.
    pub async fn propose_with_id(
        &self,
        request_id: RequestId,
        command: Command,
    ) -> Result<Committed> {
        let entry = LogEntry {
            origin: self.id,
            request_id,
            command,
        };
        let (respond_to, rx) = oneshot::channel();
        let answer = match self.send(Msg::Propose { entry, respond_to }).await {
            Ok(()) => rx.await.unwrap_or_else(|_| {
                Err(ConsensusError::OutcomeUnknown {
                    request_id,
                    reason: "the consensus actor stopped".into(),
                })
            }),
            Err(e) => Err(e),
        };
        self.proposals.count(&answer);
        answer
    }

    /// How the proposals made through this replica's handles have ended so far.
    pub fn proposal_counts(&self) -> ProposalCounts {
        self.proposals.counts()
    }

    /// Adds a node as a learner (it receives the log but does not vote).
    pub async fn add_learner(
        &self,
        raft_id: u64,
        peer_id: String,
        capability: Option<NodeCapability>,
    ) -> Result<Committed> {
        self.propose(Command::NodeJoined {
            raft_id,
            peer_id,
            capability,
        })
        .await
    }

    /// Promotes a learner to voter; refused once the voter cap is reached.
    pub async fn promote(&self, raft_id: u64) -> Result<Committed> {
        self.propose(Command::NodePromoted { raft_id }).await
    }

    /// Removes a member from the group.
    pub async fn remove(&self, raft_id: u64) -> Result<Committed> {
        self.propose(Command::NodeLeft { raft_id }).await
    }

    /// Reads this replica's state as applied so far. It may lag the leader by
    /// however far this replica lags (usually a heartbeat; unbounded if it is
    /// partitioned away). Use for dashboards and listings, not for decisions.
    pub async fn read_local<R, F>(&self, f: F) -> Result<R>
    where
        R: Send + 'static,
        F: FnOnce(&StateMachine) -> R + Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        let read: ReadFn = Box::new(move |state| {
            let _ = tx.send(state.map(f));
        });
        self.send(Msg::ReadLocal { read }).await?;
        rx.await.map_err(|_| ConsensusError::Stopped)?
    }

    /// Reads a state that includes every write committed before the call (Raft
    /// ReadIndex: the leader confirms its leadership with a quorum, and this
    /// replica waits until it has applied up to the leader's commit index). Works
    /// on the leader, followers and learners.
    ///
    /// While no leader is known (an election, or a replica that just started) the
    /// read waits for one rather than failing at once; if none appears, or the
    /// leader cannot confirm itself, within [`ReplicaConfig::read_timeout`], it
    /// fails with [`ConsensusError::ReadTimeout`] saying which step was missing.
    pub async fn read_linearizable<R, F>(&self, f: F) -> Result<R>
    where
        R: Send + 'static,
        F: FnOnce(&StateMachine) -> R + Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        let read: ReadFn = Box::new(move |state| {
            let _ = tx.send(state.map(f));
        });
        self.send(Msg::ReadLinearizable { read }).await?;
        rx.await.map_err(|_| ConsensusError::Stopped)?
    }

    pub async fn status(&self) -> Result<Status> {
        let (respond_to, rx) = oneshot::channel();
        self.send(Msg::Status { respond_to }).await?;
        rx.await.map_err(|_| ConsensusError::Stopped)
    }

    /// The latest status, updated after every round of the actor's loop.
    pub fn watch_status(&self) -> watch::Receiver<Status> {
        self.status.clone()
    }

    /// Every applied entry, in log order, from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<AppliedEvent> {
        self.events.subscribe()
    }

    /// Hands a frame received from peer `from` (its raft id, as the transport
    /// authenticated it) to the replica. Malformed frames are logged and dropped.
    pub async fn receive(&self, from: u64, frame: Vec<u8>) -> Result<()> {
        self.send(Msg::Receive { from, frame }).await
    }

    /// Like [`Self::receive`] but never waits: returns false (frame dropped, as a
    /// congested network would) when the inbox is full or the actor stopped.
    pub fn try_receive(&self, from: u64, frame: Vec<u8>) -> bool {
        self.tx.try_send(Msg::Receive { from, frame }).is_ok()
    }

    /// Makes this replica start an election now.
    pub async fn campaign(&self) -> Result<()> {
        let (respond_to, rx) = oneshot::channel();
        self.send(Msg::Campaign { respond_to }).await?;
        rx.await.map_err(|_| ConsensusError::Stopped)?
    }

    /// Asks the leader (this replica, if it leads) to hand leadership to `to`.
    pub async fn transfer_leader(&self, to: u64) -> Result<()> {
        self.send(Msg::TransferLeader { to }).await
    }

    /// Tells the replica that the transport has lost replica `id` (its connections
    /// closed and a redial failed). Raft stops streaming to it until it answers again;
    /// and if `id` is this follower's leader, the follower stops waiting out the
    /// leader's lease and campaigns within a few ticks (staggered by replica id so
    /// that followers rarely split the vote). Only liveness changes: an election
    /// still needs a majority, and pre-vote keeps a healthy leader in place when
    /// other followers still hear it.
    pub async fn peer_unreachable(&self, id: u64) -> Result<()> {
        self.send(Msg::PeerUnreachable { id }).await
    }

    /// Stops the actor and waits until its storage is closed. Everything already
    /// acknowledged is durable; nothing needs flushing.
    pub async fn shutdown(&self) {
        let (respond_to, rx) = oneshot::channel();
        if self.send(Msg::Shutdown { respond_to }).await.is_ok() {
            let _ = rx.await;
        }
        self.join().await;
    }

    /// Stops the actor abruptly, wherever it is between two awaits, as a crash
    /// would; its in-memory state is dropped. Waits until the storage is closed.
    pub async fn kill(&self) {
        let task = self.task.lock().ok().and_then(|mut t| t.take());
        if let Some(task) = task {
            task.abort();
            let _ = task.await;
        }
    }

    async fn join(&self) {
        let task = self.task.lock().ok().and_then(|mut t| t.take());
        if let Some(task) = task {
            let _ = task.await;
        }
    }

    async fn send(&self, msg: Msg) -> Result<()> {
        self.tx.send(msg).await.map_err(|_| ConsensusError::Stopped)
    }
}

/// A proposal of this replica that has no outcome yet.
struct Pending {
    entry: LogEntry,
    waiters: Vec<Reply<Committed>>,
    /// Where leaders said they appended it (index, term).
    placements: Vec<(u64, u64)>,
    /// Forwards sent and neither accepted nor refused yet.
    unacked: u32,
    /// Whether it ever left this replica or entered its log (if not, it certainly
    /// did not commit).
    sent: bool,
    /// Sitting in the current batch of this (leading) replica.
    batched: bool,
    deadline: Instant,
    next_retry: Instant,
}

/// A linearizable read waiting for its read index or for apply to reach it.
struct PendingRead {
    read: ReadFn,
    deadline: Instant,
}

/// Where a batched proposal came from.
enum Source {
    Local,
    Forwarded(u64),
}

struct Actor {
    cfg: ReplicaConfig,
    cluster: ClusterId,
    raw: RawNode<RedbStorage>,
    state: StateMachine,
    /// The conf state as of the applied index (goes into snapshots).
    conf_state: ConfState,
    transport: Arc<dyn Transport>,
    inbox: mpsc::Receiver<Msg>,
    events: broadcast::Sender<AppliedEvent>,
    status_tx: Option<watch::Sender<Status>>,
    pending: BTreeMap<RequestId, Pending>,
    /// Log index → proposals of ours a leader placed there.
    placed_at: BTreeMap<u64, Vec<RequestId>>,
    /// Normal proposals collected this round, proposed together as one message.
    batch: Vec<(LogEntry, Source)>,
    /// Linearizable reads still waiting for a read index, by arrival number.
    reads: BTreeMap<u64, PendingRead>,
    /// ReadIndex requests in flight: context sequence → the newest read (arrival
    /// number) it covers. An answer to any of them serves the reads it covers.
    read_requests: BTreeMap<u64, u64>,
    /// The leader the newest ReadIndex request went to, and when to send again if
    /// no answer came.
    read_sent: Option<(u64, Instant)>,
    /// Reads whose index is known, waiting for apply to reach it.
    confirmed_reads: Vec<(u64, PendingRead)>,
    /// Arrival number of the newest read.
    next_read: u64,
    ids: Arc<RequestIds>,
    ticks: u64,
    /// The leader as of the last tick; a change re-sends unplaced proposals at once.
    last_leader: u64,
    /// The last non-zero leader seen when publishing the status, and how many
    /// times it changed (see [`Status::leader_changes`]).
    known_leader: u64,
    leader_changes: u64,
}

/// Messages handled per round before the Ready is processed: large enough to batch
/// many proposals into one fsync, small enough to keep ticks on time.
const MAX_MSGS_PER_ROUND: usize = 4096;

/// Unanswered ReadIndex requests remembered per replica (each retry adds one).
const MAX_READ_REQUESTS: usize = 16;

impl Actor {
    async fn run(mut self) {
        let mut ticker = time::interval(self.cfg.tick_interval);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut shutdown = None;
        // Apply what an earlier run committed but had not applied.
        if let Err(e) = self.drive() {
            error!(raft_id = self.cfg.id, "consensus stopped: {e}");
            return;
        }
        loop {
            tokio::select! {
                biased;
                _ = ticker.tick() => self.on_tick(),
                msg = self.inbox.recv() => {
                    let Some(msg) = msg else { break };
                    if let Some(done) = self.handle(msg) {
                        shutdown = Some(done);
                        break;
                    }
                    for _ in 0..MAX_MSGS_PER_ROUND {
                        let Ok(msg) = self.inbox.try_recv() else { break };
                        if let Some(done) = self.handle(msg) {
                            shutdown = Some(done);
                            break;
                        }
                    }
                    if shutdown.is_some() {
                        break;
                    }
                }
            }
            self.flush_batch();
            if let Err(e) = self.drive() {
                // A storage failure leaves Raft unable to go on safely.
                error!(raft_id = self.cfg.id, "consensus stopped: {e}");
                break;
            }
        }
        let id = self.cfg.id;
        self.fail_all();
        // Close the storage before telling the caller we are done.
        drop(self);
        info!(raft_id = id, "consensus replica stopped");
        if let Some(done) = shutdown {
            let _ = done.send(());
        }
    }

    fn is_leader(&self) -> bool {
        self.raw.raft.state == StateRole::Leader
    }

    fn leader(&self) -> u64 {
        self.raw.raft.leader_id
    }

    /// Returns the shutdown responder when asked to stop.
    fn handle(&mut self, msg: Msg) -> Option<oneshot::Sender<()>> {
        match msg {
            Msg::Propose { entry, respond_to } => self.on_propose(entry, respond_to),
            Msg::Receive { from, frame } => self.on_frame(from, &frame),
            Msg::ReadLocal { read } => read(Ok(&self.state)),
            Msg::ReadLinearizable { read } => {
                // Sent in `issue_reads`, batched with the other reads of this round.
                self.next_read += 1;
                let deadline = Instant::now() + self.cfg.read_timeout;
                self.reads
                    .insert(self.next_read, PendingRead { read, deadline });
            }
            Msg::Status { respond_to } => {
                let _ = respond_to.send(self.status());
            }
            Msg::Campaign { respond_to } => {
                let _ = respond_to.send(self.raw.campaign().map_err(Into::into));
            }
            Msg::TransferLeader { to } => self.raw.transfer_leader(to),
            Msg::PeerUnreachable { id } => self.on_peer_unreachable(id),
            Msg::Shutdown { respond_to } => return Some(respond_to),
        }
        None
    }

    fn on_peer_unreachable(&mut self, id: u64) {
        if id == self.cfg.id {
            return;
        }
        self.raw.report_unreachable(id);
        let raft = &mut self.raw.raft;
        if raft.state == StateRole::Follower && raft.leader_id == id {
            let stagger = 1 + (self.cfg.id % 3) as usize;
            let elapsed = raft
                .randomized_election_timeout()
                .saturating_sub(stagger)
                .max(raft.election_timeout());
            if elapsed > raft.election_elapsed {
                tracing::info!(
                    leader = id,
                    "lost the connection to the leader; campaigning without waiting out its lease"
                );
                raft.election_elapsed = elapsed;
            }
        }
    }

    fn on_propose(&mut self, entry: LogEntry, respond_to: Reply<Committed>) {
        let request_id = entry.request_id;
        if let Some(done) = self.state.outcome_of(&request_id) {
            let _ = respond_to.send(Ok(done));
            return;
        }
        if let Some(p) = self.pending.get_mut(&request_id) {
            p.waiters.push(respond_to);
            return;
        }
        let now = Instant::now();
        self.pending.insert(
            request_id,
            Pending {
                entry,
                waiters: vec![respond_to],
                placements: Vec::new(),
                unacked: 0,
                sent: false,
                batched: false,
                deadline: now + self.cfg.proposal_timeout,
                next_retry: now,
            },
        );
        self.place(request_id);
    }

    /// Gets a pending proposal into some leader's log: ours if we lead, else by
    /// forwarding. Without a known leader it waits for a later tick.
    fn place(&mut self, request_id: RequestId) {
        let leading = self.is_leader();
        let leader = self.leader();
        let retry_after = self.cfg.tick_interval * self.cfg.election_tick as u32;
        let Some(p) = self.pending.get_mut(&request_id) else {
            return;
        };
        p.next_retry = Instant::now() + retry_after;
        if leading {
            if p.entry.command.is_membership_change() {
                let entry = p.entry.clone();
                match self.propose_conf_change(&entry) {
                    Ok(Some(at)) => self.record_placement(request_id, at),
                    // Another change is in flight: try again next tick.
                    Ok(None) => {}
                    Err(reason) => self.drop_pending(request_id, reason),
                }
            } else if !p.batched {
                p.batched = true;
                p.sent = true;
                self.batch.push((p.entry.clone(), Source::Local));
            }
        } else if leader != 0 {
            p.sent = true;
            p.unacked += 1;
            let body = FrameBody::Forward(p.entry.clone());
            self.send_frame(leader, body);
        }
    }

    fn record_placement(&mut self, request_id: RequestId, (index, term): (u64, u64)) {
        if index <= self.state.applied_index() {
            // Already applied here and it was not ours (ours would have resolved the
            // proposal): that placement lost.
            if let Some(p) = self.pending.get_mut(&request_id) {
                p.sent = true;
                p.placements.push((index, term));
            }
            self.unplace(request_id, index);
            return;
        }
        if let Some(p) = self.pending.get_mut(&request_id) {
            p.sent = true;
            if !p.placements.contains(&(index, term)) {
                p.placements.push((index, term));
                self.placed_at.entry(index).or_default().push(request_id);
            }
        }
    }

    fn drop_pending(&mut self, request_id: RequestId, reason: String) {
        if let Some(p) = self.pending.remove(&request_id) {
            for w in p.waiters {
                let _ = w.send(Err(ConsensusError::ProposalDropped {
                    request_id,
                    reason: reason.clone(),
                }));
            }
        }
    }

    fn resolve(&mut self, request_id: RequestId, committed: &Committed) {
        if let Some(p) = self.pending.remove(&request_id) {
            for w in p.waiters {
                let _ = w.send(Ok(committed.clone()));
            }
        }
    }

    /// Proposes a membership change as a Raft ConfChange carrying the log entry.
    /// `Ok(None)`: another change is pending; retry later.
    fn propose_conf_change(&mut self, entry: &LogEntry) -> Result<Option<(u64, u64)>, String> {
        if self.raw.raft.has_pending_conf() {
            return Ok(None);
        }
        let (change_type, node_id) = match &entry.command {
            Command::NodeJoined { raft_id, .. } => (ConfChangeType::AddLearnerNode, *raft_id),
            Command::NodePromoted { raft_id } => (ConfChangeType::AddNode, *raft_id),
            Command::NodeLeft { raft_id } => (ConfChangeType::RemoveNode, *raft_id),
            other => return Err(format!("{} is not a membership change", other.kind())),
        };
        // No early verdict here: apply judges every change against the replicated
        // state, so the proposer gets a committed Outcome either way.
        let mut cc = ConfChange::default();
        cc.set_change_type(change_type);
        cc.node_id = node_id;
        cc.context = codec::to_bytes(entry).map_err(|e| e.to_string())?.into();
        let before = self.raw.raft.raft_log.last_index();
        self.raw
            .propose_conf_change(vec![], cc)
            .map_err(|e| e.to_string())?;
        let after = self.raw.raft.raft_log.last_index();
        if after == before {
            return Err("raft dropped the proposal".into());
        }
        Ok(Some((after, self.raw.raft.term)))
    }

    /// Proposes this round's normal proposals as one MsgPropose: one append, one
    /// broadcast, one fsync for all of them.
    fn flush_batch(&mut self) {
        if self.batch.is_empty() {
            return;
        }
        let batch = std::mem::take(&mut self.batch);
        let mut msg = RaftMessage::default();
        msg.set_msg_type(MessageType::MsgPropose);
        msg.from = self.cfg.id;
        let mut encoded = Vec::with_capacity(batch.len());
        for (entry, _) in &batch {
            match codec::to_bytes(entry) {
                Ok(data) => {
                    encoded.push(Entry {
                        data: data.into(),
                        ..Default::default()
                    });
                }
                Err(e) => encoded.push({
                    warn!(request_id = %entry.request_id, "cannot encode proposal: {e}");
                    Entry::default()
                }),
            }
        }
        msg.set_entries(encoded.into());
        let before = self.raw.raft.raft_log.last_index();
        let result = if self.is_leader() {
            self.raw.step(msg).map_err(|e| e.to_string())
        } else {
            Err("no longer the leader".to_string())
        };
        let after = self.raw.raft.raft_log.last_index();
        let term = self.raw.raft.term;
        let appended = result.is_ok() && after == before + batch.len() as u64;
        let leader = self.leader();
        for (i, (entry, source)) in batch.into_iter().enumerate() {
            let at = (before + 1 + i as u64, term);
            match source {
                Source::Local => {
                    if let Some(p) = self.pending.get_mut(&entry.request_id) {
                        p.batched = false;
                    }
                    if appended {
                        self.record_placement(entry.request_id, at);
                    }
                    // Otherwise it stays pending and is forwarded on a later tick.
                }
                Source::Forwarded(origin) => {
                    let body = if appended {
                        FrameBody::ForwardAccepted {
                            request_id: entry.request_id,
                            index: at.0,
                            term: at.1,
                        }
                    } else {
                        FrameBody::ForwardRefused {
                            request_id: entry.request_id,
                            leader,
                            reason: result
                                .clone()
                                .err()
                                .unwrap_or_else(|| "raft dropped the proposal".into()),
                        }
                    };
                    self.send_frame(origin, body);
                }
            }
        }
    }

    fn on_frame(&mut self, from: u64, bytes: &[u8]) {
        let frame = match Frame::decode(bytes) {
            Ok(f) => f,
            Err(e) => {
                warn!(raft_id = self.cfg.id, from, "dropping malformed frame: {e}");
                return;
            }
        };
        if frame.cluster != self.cluster {
            warn!(
                raft_id = self.cfg.id,
                from,
                theirs = %frame.cluster,
                ours = %self.cluster,
                "dropping frame from another cluster"
            );
            return;
        }
        if frame.from != from {
            warn!(
                raft_id = self.cfg.id,
                from,
                claimed = frame.from,
                "dropping frame whose sender does not match the transport's"
            );
            return;
        }
        match frame.body {
            FrameBody::Raft(bytes) => self.on_raft_message(from, &bytes),
            FrameBody::Forward(entry) => self.on_forward(from, entry),
            FrameBody::ForwardAccepted {
                request_id,
                index,
                term,
            } => {
                if let Some(p) = self.pending.get_mut(&request_id) {
                    p.unacked = p.unacked.saturating_sub(1);
                    self.record_placement(request_id, (index, term));
                }
            }
            FrameBody::ForwardRefused {
                request_id,
                leader,
                reason,
            } => {
                debug!(raft_id = self.cfg.id, %request_id, leader, "forward refused: {reason}");
                if let Some(p) = self.pending.get_mut(&request_id) {
                    p.unacked = p.unacked.saturating_sub(1);
                    // Retry at the next tick, when the leader may be known.
                    p.next_retry = Instant::now();
                }
            }
        }
    }

    fn on_raft_message(&mut self, from: u64, bytes: &[u8]) {
        let msg = match decode_raft(bytes) {
            Ok(m) => m,
            Err(e) => {
                warn!(
                    raft_id = self.cfg.id,
                    from, "dropping malformed raft message: {e}"
                );
                return;
            }
        };
        if msg.from != from || msg.to != self.cfg.id {
            warn!(
                raft_id = self.cfg.id,
                from,
                msg_from = msg.from,
                msg_to = msg.to,
                "dropping misaddressed raft message"
            );
            return;
        }
        if raft::raw_node::is_local_msg(msg.get_msg_type()) {
            warn!(
                raft_id = self.cfg.id,
                from, "dropping local-only raft message type"
            );
            return;
        }
        if msg.get_msg_type() == MessageType::MsgSnapshot {
            // Check the state inside before raft-rs adopts it: a snapshot we cannot
            // restore must not replace our log.
            if let Err(e) = StateMachine::from_bytes(&msg.get_snapshot().data) {
                warn!(
                    raft_id = self.cfg.id,
                    from, "dropping snapshot with bad state: {e}"
                );
                return;
            }
        }
        tracing::trace!(
            raft_id = self.cfg.id,
            from,
            kind = ?msg.get_msg_type(),
            index = msg.index,
            entries = ?msg.entries.iter().map(|e| (e.index, e.term)).collect::<Vec<_>>(),
            last = self.raw.raft.raft_log.last_index(),
            "step"
        );
        if let Err(e) = self.raw.step(msg) {
            debug!(raft_id = self.cfg.id, from, "raft ignored message: {e}");
        }
    }

    fn on_forward(&mut self, from: u64, entry: LogEntry) {
        let request_id = entry.request_id;
        if entry.origin != from {
            warn!(
                raft_id = self.cfg.id,
                from,
                origin = entry.origin,
                "dropping forwarded proposal with a foreign origin"
            );
            return;
        }
        if !self.is_leader() {
            let leader = self.leader();
            self.send_frame(
                from,
                FrameBody::ForwardRefused {
                    request_id,
                    leader,
                    reason: "not the leader".into(),
                },
            );
            return;
        }
        if entry.command.is_membership_change() {
            let body = match self.propose_conf_change(&entry) {
                Ok(Some((index, term))) => FrameBody::ForwardAccepted {
                    request_id,
                    index,
                    term,
                },
                Ok(None) => FrameBody::ForwardRefused {
                    request_id,
                    leader: self.cfg.id,
                    reason: "another membership change is in progress".into(),
                },
                Err(reason) => FrameBody::ForwardRefused {
                    request_id,
                    leader: self.cfg.id,
                    reason,
                },
            };
            self.send_frame(from, body);
            return;
        }
        self.batch.push((entry, Source::Forwarded(from)));
    }

    fn on_tick(&mut self) {
        self.raw.tick();
        self.ticks += 1;
        let now = Instant::now();

        // A new leader: proposals forwarded to the old one (now lost) go to it at
        // once rather than after the retry interval.
        let leader = self.leader();
        if leader != self.last_leader {
            self.last_leader = leader;
            if leader != 0 {
                for p in self.pending.values_mut() {
                    p.next_retry = now;
                }
            }
        }

        // Proposals: answer the expired, retry the unplaced.
        let mut expired = Vec::new();
        let mut retry = Vec::new();
        for (id, p) in &self.pending {
            if now >= p.deadline {
                expired.push(*id);
            } else if p.placements.is_empty() && !p.batched && now >= p.next_retry {
                retry.push(*id);
            }
        }
        for id in expired {
            if let Some(p) = self.pending.remove(&id) {
                let err = || {
                    if p.sent {
                        ConsensusError::OutcomeUnknown {
                            request_id: id,
                            reason: "no commit seen before the deadline".into(),
                        }
                    } else {
                        ConsensusError::NoLeader
                    }
                };
                for w in p.waiters {
                    let _ = w.send(Err(err()));
                }
            }
        }
        for id in retry {
            self.place(id);
        }

        self.expire_reads(now);

        if self.cfg.auto_promote && self.is_leader() && self.ticks % 5 == 0 {
            self.maybe_promote();
        }
    }

    /// Promotes one caught-up learner while voters are below the cap.
    fn maybe_promote(&mut self) {
        if self.raw.raft.has_pending_conf()
            || self.state.voter_count() >= self.state.settings().max_voters as usize
        {
            return;
        }
        let last = self.raw.raft.raft_log.last_index();
        let learner = self.state.members().values().find(|m| {
            m.role == crate::state::Role::Learner
                && self
                    .raw
                    .raft
                    .prs()
                    .get(m.raft_id)
                    .is_some_and(|p| p.matched + 100 >= last)
        });
        let Some(learner) = learner.map(|m| m.raft_id) else {
            return;
        };
        let entry = LogEntry {
            origin: self.cfg.id,
            request_id: self.ids.next_id(),
            command: Command::NodePromoted { raft_id: learner },
        };
        match self.propose_conf_change(&entry) {
            Ok(Some(_)) => info!(raft_id = self.cfg.id, learner, "promoting learner"),
            Ok(None) => {}
            Err(e) => debug!(raft_id = self.cfg.id, "not promoting: {e}"),
        }
    }

    /// Handles every pending Ready (see the module docs for the order).
    fn drive(&mut self) -> Result<()> {
        loop {
            // Before each Ready: a read answered in the last one may let the next
            // batch go out at once.
            self.issue_reads();
            if !self.raw.has_ready() {
                break;
            }
            let mut ready = self.raw.ready();
            tracing::trace!(
                raft_id = self.cfg.id,
                number = ready.number(),
                entries = ?ready.entries().first().map(|e| (e.index, ready.entries().len())),
                msgs = ready.messages().len(),
                persisted_msgs = ready.persisted_messages().len(),
                committed = ready.committed_entries().len(),
                "ready"
            );
            if !ready.messages().is_empty() {
                self.send_raft(ready.take_messages());
            }
            let snapshot = (!ready.snapshot().is_empty()).then(|| ready.snapshot().clone());
            if snapshot.is_some() || !ready.entries().is_empty() || ready.hs().is_some() {
                self.raw
                    .mut_store()
                    .persist(snapshot.as_ref(), ready.entries(), ready.hs())?;
            }
            if let Some(snapshot) = snapshot {
                self.restore(&snapshot)?;
            }
            self.on_read_states(ready.take_read_states());
            self.apply_entries(ready.take_committed_entries());
            if !ready.persisted_messages().is_empty() {
                self.send_raft(ready.take_persisted_messages());
            }
            let mut light = self.raw.advance(ready);
            if let Some(commit) = light.commit_index() {
                self.raw.mut_store().set_commit(commit);
            }
            self.send_raft(light.take_messages());
            self.apply_entries(light.take_committed_entries());
            self.raw.advance_apply();
        }
        self.serve_reads();
        self.maybe_snapshot()?;
        self.publish_status();
        Ok(())
    }

    fn send_raft(&mut self, msgs: Vec<RaftMessage>) {
        for msg in msgs {
            let to = msg.to;
            let is_snapshot = msg.get_msg_type() == MessageType::MsgSnapshot;
            let delivered = match encode_raft(&msg) {
                Ok(bytes) => self.send_frame(to, FrameBody::Raft(bytes)),
                Err(e) => {
                    error!(raft_id = self.cfg.id, to, "cannot encode raft message: {e}");
                    false
                }
            };
            if !delivered {
                self.raw.report_unreachable(to);
            }
            if is_snapshot {
                // The transport gives no receipt: report at once. If the snapshot is
                // lost, the follower rejects the next append and Raft sends it again.
                let status = if delivered {
                    raft::SnapshotStatus::Finish
                } else {
                    raft::SnapshotStatus::Failure
                };
                self.raw.report_snapshot(to, status);
            }
        }
    }

    /// Sends a frame; false if the transport says the peer is unreachable.
    fn send_frame(&self, to: u64, body: FrameBody) -> bool {
        let frame = Frame {
            cluster: self.cluster,
            from: self.cfg.id,
            body,
        };
        match frame.encode() {
            Ok(bytes) => self.transport.send(to, bytes).is_ok(),
            Err(e) => {
                error!(raft_id = self.cfg.id, to, "cannot encode frame: {e}");
                false
            }
        }
    }

    fn restore(&mut self, snapshot: &Snapshot) -> Result<()> {
        let meta = snapshot.get_metadata();
        self.state = StateMachine::from_bytes(&snapshot.data)?;
        self.conf_state = meta.get_conf_state().clone();
        info!(
            raft_id = self.cfg.id,
            index = meta.index,
            term = meta.term,
            "restored state from a snapshot"
        );
        let _ = self.events.send(AppliedEvent::Restored {
            index: meta.index,
            term: meta.term,
        });
        // Proposals placed at or below the snapshot: the state says what happened.
        let covered: Vec<u64> = self
            .placed_at
            .range(..=meta.index)
            .map(|(i, _)| *i)
            .collect();
        for index in covered {
            for request_id in self.placed_at.remove(&index).unwrap_or_default() {
                match self.state.outcome_of(&request_id) {
                    Some(done) => self.resolve(request_id, &done),
                    None => self.unplace(request_id, index),
                }
            }
        }
        // Our own proposals may also be inside without a known placement.
        let inside: Vec<(RequestId, Committed)> = self
            .pending
            .keys()
            .filter_map(|id| self.state.outcome_of(id).map(|c| (*id, c)))
            .collect();
        for (id, done) in inside {
            self.resolve(id, &done);
        }
        Ok(())
    }

    /// The entry at `index` is not `request_id`'s: forget that placement, and if
    /// no other could still commit, the proposal certainly failed.
    fn unplace(&mut self, request_id: RequestId, index: u64) {
        let Some(p) = self.pending.get_mut(&request_id) else {
            return;
        };
        p.placements.retain(|(i, _)| *i != index);
        if p.placements.is_empty() && p.unacked == 0 && !p.batched {
            self.drop_pending(
                request_id,
                format!("a different entry was committed at index {index} (leader changed)"),
            );
        }
    }

    /// Sends a ReadIndex request covering every waiting read, when one is due: none
    /// in flight, the leader changed since the last one, or it went unanswered
    /// for a few heartbeats (raft-rs drops requests silently, see the module docs).
    fn issue_reads(&mut self) {
        let Some(&newest) = self.reads.keys().next_back() else {
            return;
        };
        let leader = self.leader();
        // Without a leader a follower drops the request, and a leader drops it until
        // it has committed an entry in its term; a commit in the current term seen
        // here means the leader has one. Wait for that instead of sending in vain.
        if leader == 0 || !self.raw.raft.commit_to_current_term() {
            return;
        }
        let now = Instant::now();
        let due = self.read_requests.is_empty()
            || self
                .read_sent
                .is_none_or(|(to, retry_at)| to != leader || now >= retry_at);
        if !due {
            return;
        }
        let ctx = self.ids.next_id();
        self.read_requests.insert(ctx.seq, newest);
        // Bound the answers we still wait for (older ones cover fewer reads).
        while self.read_requests.len() > MAX_READ_REQUESTS {
            self.read_requests.pop_first();
        }
        let retry_after = self.cfg.tick_interval * (2 * self.cfg.heartbeat_tick as u32).max(3);
        self.read_sent = Some((leader, now + retry_after));
        let mut bytes = Vec::with_capacity(16);
        bytes.extend_from_slice(&ctx.client.to_le_bytes());
        bytes.extend_from_slice(&ctx.seq.to_le_bytes());
        self.raw.read_index(bytes);
    }

    fn on_read_states(&mut self, states: Vec<raft::ReadState>) {
        for rs in states {
            let ctx = rs.request_ctx.as_slice();
            if ctx.len() != 16 {
                continue;
            }
            let (client, seq) = ctx.split_at(8);
            let (Ok(client), Ok(seq)) = (<[u8; 8]>::try_from(client), <[u8; 8]>::try_from(seq))
            else {
                continue;
            };
            if u64::from_le_bytes(client) != self.cfg.id {
                continue;
            }
            let Some(covers) = self.read_requests.get(&u64::from_le_bytes(seq)).copied() else {
                // Answered already through a later request, or expired.
                continue;
            };
            // Earlier requests cover fewer reads: they are settled too.
            self.read_requests.retain(|_, c| *c > covers);
            let later = self.reads.split_off(&(covers + 1));
            let served = std::mem::replace(&mut self.reads, later);
            self.confirmed_reads
                .extend(served.into_values().map(|r| (rs.index, r)));
        }
        if self.read_requests.is_empty() {
            self.read_sent = None;
        }
    }

    fn serve_reads(&mut self) {
        if self.confirmed_reads.is_empty() {
            return;
        }
        let applied = self.state.applied_index();
        let (ready, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.confirmed_reads)
            .into_iter()
            .partition(|(index, _)| *index <= applied);
        self.confirmed_reads = waiting;
        for (_, r) in ready {
            (r.read)(Ok(&self.state));
        }
    }

    /// Answers the reads whose deadline passed, saying which step was missing.
    fn expire_reads(&mut self, now: Instant) {
        let late: Vec<u64> = self
            .reads
            .iter()
            .filter(|(_, r)| now >= r.deadline)
            .map(|(n, _)| *n)
            .collect();
        if !late.is_empty() {
            let reason = self.unconfirmed_read_reason();
            for n in late {
                if let Some(r) = self.reads.remove(&n) {
                    (r.read)(Err(ConsensusError::ReadTimeout {
                        reason: reason.clone(),
                    }));
                }
            }
            // Requests that cover no waiting read any more.
            match self.reads.keys().next() {
                Some(&oldest) => self.read_requests.retain(|_, c| *c >= oldest),
                None => self.read_requests.clear(),
            }
            if self.read_requests.is_empty() {
                self.read_sent = None;
            }
        }
        if self.confirmed_reads.iter().any(|(_, r)| now >= r.deadline) {
            let applied = self.state.applied_index();
            let (late, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.confirmed_reads)
                .into_iter()
                .partition(|(_, r)| now >= r.deadline);
            self.confirmed_reads = waiting;
            for (index, r) in late {
                (r.read)(Err(ConsensusError::ReadTimeout {
                    reason: format!(
                        "the leader confirmed read index {index}, but this replica has \
                         applied only up to {applied} (it is catching up)"
                    ),
                }));
            }
        }
    }

    /// Why a read still has no read index.
    fn unconfirmed_read_reason(&self) -> String {
        let leader = self.leader();
        if leader == 0 {
            "no Raft leader is known to this replica (an election is under way, or it \
             cannot reach a quorum of the mesh)"
                .into()
        } else if !self.raw.raft.commit_to_current_term() {
            if self.is_leader() {
                "this replica was just elected leader and has not yet committed an entry \
                 in its term, which a quorum must acknowledge first"
                    .into()
            } else {
                format!(
                    "this replica has not yet seen leader {leader} commit an entry in its \
                     term (it may be catching up, or the leader lacks a quorum)"
                )
            }
        } else {
            format!("leader {leader} did not confirm its leadership with a quorum in time")
        }
    }

    fn apply_entries(&mut self, entries: Vec<Entry>) {
        for entry in entries {
            let (index, term) = (entry.index, entry.term);
            if index <= self.state.applied_index() {
                continue;
            }
            match entry.get_entry_type() {
                EntryType::EntryNormal if entry.data.is_empty() => {
                    // A new leader's empty entry.
                    self.state.skip(index, term);
                    self.settle(index, None);
                }
                EntryType::EntryNormal => match codec::from_bytes::<LogEntry>(&entry.data) {
                    Ok(le) => {
                        let applied = self.state.apply(index, term, &le);
                        self.finish(index, term, le, applied);
                    }
                    Err(e) => {
                        // Every replica skips the same bytes alike: still deterministic.
                        error!(
                            raft_id = self.cfg.id,
                            index, "skipping undecodable entry: {e}"
                        );
                        self.state.skip(index, term);
                        self.settle(index, None);
                    }
                },
                EntryType::EntryConfChange => self.apply_conf_change(&entry),
                EntryType::EntryConfChangeV2 => {
                    warn!(
                        raft_id = self.cfg.id,
                        index, "skipping unexpected ConfChangeV2"
                    );
                    self.state.skip(index, term);
                    self.settle(index, None);
                }
            }
        }
    }

    fn apply_conf_change(&mut self, entry: &Entry) {
        let (index, term) = (entry.index, entry.term);
        let decoded = ConfChange::parse_from_bytes(&entry.data)
            .map_err(|e| e.to_string())
            .and_then(|cc| {
                codec::from_bytes::<LogEntry>(&cc.context)
                    .map(|le| (cc, le))
                    .map_err(|e| e.to_string())
            });
        let (cc, le) = match decoded {
            Ok(x) => x,
            Err(e) => {
                error!(
                    raft_id = self.cfg.id,
                    index, "skipping undecodable conf change: {e}"
                );
                self.state.skip(index, term);
                self.settle(index, None);
                return;
            }
        };
        let applied = if self.state.outcome_of(&le.request_id).is_some() {
            self.state.apply(index, term, &le)
        } else {
            match self.state.membership_verdict(&le.command) {
                Ok(()) => match self.raw.apply_conf_change(&cc) {
                    Ok(cs) => {
                        self.conf_state = cs;
                        self.state.apply(index, term, &le)
                    }
                    Err(e) => self.state.conclude(
                        index,
                        term,
                        &le,
                        Outcome::Rejected(format!("raft refused: {e}")),
                    ),
                },
                Err(outcome) => self.state.conclude(index, term, &le, outcome),
            }
        };
        info!(
            raft_id = self.cfg.id,
            index,
            change = le.command.kind(),
            node = cc.node_id,
            outcome = ?applied.committed.outcome,
            "membership change applied"
        );
        self.finish(index, term, le, applied);
    }

    fn finish(&mut self, index: u64, term: u64, entry: LogEntry, applied: Applied) {
        let request_id = entry.request_id;
        if entry.origin == self.cfg.id {
            self.resolve(request_id, &applied.committed);
        }
        self.settle(index, Some(request_id));
        let _ = self.events.send(AppliedEvent::Entry {
            index,
            term,
            entry: Arc::new(entry),
            committed: applied.committed,
            duplicate: applied.duplicate,
        });
    }

    /// Index `index` is applied with `request_id` (if any): other proposals placed
    /// there lost their slot.
    fn settle(&mut self, index: u64, request_id: Option<RequestId>) {
        if self.placed_at.is_empty() {
            return;
        }
        // Placements below are settled too (they may be skipped by a snapshot).
        let done: Vec<u64> = self.placed_at.range(..=index).map(|(i, _)| *i).collect();
        for i in done {
            for id in self.placed_at.remove(&i).unwrap_or_default() {
                if Some(id) != request_id || i != index {
                    self.unplace(id, i);
                }
            }
        }
    }

    fn maybe_snapshot(&mut self) -> Result<()> {
        let applied = self.state.applied_index();
        let snap_index = self.raw.store().snapshot_metadata().index;
        let requested = self.raw.store().take_snapshot_request();
        if applied <= snap_index
            || (!requested && applied - snap_index < self.cfg.snapshot_interval)
        {
            return Ok(());
        }
        let mut snapshot = Snapshot {
            data: self.state.to_bytes()?.into(),
            ..Default::default()
        };
        let meta = snapshot.mut_metadata();
        meta.index = applied;
        meta.term = self.state.applied_term();
        meta.set_conf_state(self.conf_state.clone());
        let compact_to = (applied + 1).saturating_sub(self.cfg.log_retain);
        self.raw.mut_store().compact(snapshot, compact_to)?;
        debug!(
            raft_id = self.cfg.id,
            index = applied,
            "snapshot taken, log compacted"
        );
        Ok(())
    }

    fn status(&self) -> Status {
        let raft = &self.raw.raft;
        let store = self.raw.store();
        let conf = raft.prs().conf().to_conf_state();
        let mut voters = conf.voters.clone();
        voters.sort_unstable();
        let mut learners = conf.learners.clone();
        learners.sort_unstable();
        Status {
            id: self.cfg.id,
            role: raft.state.into(),
            leader_id: raft.leader_id,
            term: raft.term,
            commit_index: raft.raft_log.committed,
            applied_index: self.state.applied_index(),
            first_index: store.first(),
            last_index: raft.raft_log.last_index(),
            snapshot_index: store.snapshot_metadata().index,
            voters,
            learners,
            pending_proposals: self.pending.len(),
            leader_changes: self.leader_changes,
        }
    }

    fn publish_status(&mut self) {
        let leader = self.leader();
        if leader != 0 && leader != self.known_leader {
            self.known_leader = leader;
            self.leader_changes += 1;
        }
        let status = self.status();
        if let Some(tx) = &self.status_tx {
            tx.send_if_modified(|s| {
                if *s != status {
                    *s = status;
                    true
                } else {
                    false
                }
            });
        }
    }

    fn fail_all(&mut self) {
        for (id, p) in std::mem::take(&mut self.pending) {
            for w in p.waiters {
                let _ = w.send(Err(if p.sent {
                    ConsensusError::OutcomeUnknown {
                        request_id: id,
                        reason: "the consensus actor stopped".into(),
                    }
                } else {
                    ConsensusError::Stopped
                }));
            }
        }
        for (_, r) in std::mem::take(&mut self.reads) {
            (r.read)(Err(ConsensusError::Stopped));
        }
        for (_, r) in self.confirmed_reads.drain(..) {
            (r.read)(Err(ConsensusError::Stopped));
        }
    }
}
