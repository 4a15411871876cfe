//! The consensus actor: owns the raft-rs `RawNode`, its [`RedbStorage`] and the
//! [`StateMachine`]; talks to peers only through a [`Transport`], and to the rest
//! of the node through a [`ConsensusHandle`].
//!
//! One loop: tick on a timer, step messages from peers, collect proposals, then
//! handle every Ready in the order raft-rs documents — send the leader's messages
//! at once (a leader may replicate before its own fsync, Raft thesis §10.2.1),
//! persist a received snapshot, entries and hard state (one append and `fdatasync`
//! of the log file, [`RedbStorage::persist`]), apply committed entries, and only
//! then send the messages that depend on the persisted state (votes, append
//! responses). Then `advance`, and the same for the LightReady. A snapshot of its
//! own the replica encodes and writes off its task, and compacts the log when the
//! files are written ([`RedbStorage::begin_compaction`]).
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

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpumesh_protocol::{codec, NodeCapability};
use protobuf::Message as _;
use raft::eraftpb::{
    ConfChange, ConfChangeType, ConfState, Entry, EntryType, Message as RaftMessage, MessageType,
    Snapshot, SnapshotMetadata,
};
use raft::{RawNode, StateRole};
use tokio::sync::{broadcast, mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::{self, Instant, MissedTickBehavior};
use tracing::{debug, error, info, warn};

use crate::carried::CarriedStore;
use crate::cluster::ClusterId;
use crate::command::{Command, Committed, LogEntry, Outcome, RequestId, RequestIds};
use crate::error::{ConsensusError, Result};
use crate::state::{Applied, StateMachine};
use crate::storage::RedbStorage;
use crate::tracing_drain::raft_logger;
use crate::transport::Transport;
use crate::wire::{decode_raft, encode_raft, Frame, FrameBody};

mod apply;
mod handle;
mod proposals;
mod reads;
mod ready;
mod snapshots;

pub use handle::{with_waiting, ConsensusHandle, Received};

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
    /// Take a snapshot and compact the log after this many applied entries, or
    /// sooner once the log held in memory reaches `snapshot_bytes`. Each replica
    /// goes a little before either (by up to an eighth, drawn from its id), so
    /// replicas applying the same entries do not all stop for a snapshot at once.
    /// A snapshot of a full record (10,000 finished tasks, ~9 MB) takes 0.1-0.2 s
    /// of the replica's thread on a small machine.
    pub snapshot_interval: u64,
    /// See `snapshot_interval`: bounds the memory the log takes between snapshots.
    pub snapshot_bytes: u64,
    /// Entries kept in the log behind a snapshot, so a follower that lags a little
    /// catches up from the log rather than a full snapshot.
    pub log_retain: u64,
    /// At most this many bytes of entries are kept behind a snapshot, whatever
    /// `log_retain` says: a compaction writes what it keeps into the log's next
    /// file, and entries carrying results make a thousand entries tens of MB.
    pub log_retain_bytes: u64,
    /// How long a proposal may take before its caller gets an answer anyway
    /// (sooner, NoLeader, where it could not be sent while the replica has known
    /// no leader for [`LEADERLESS_ELECTIONS`] election timeouts).
    pub proposal_timeout: Duration,
    /// How long a linearizable read may wait for a quorum.
    pub read_timeout: Duration,
    /// Leader-side: promote caught-up learners while voters are below the cap.
    pub auto_promote: bool,
    /// Leader-side: hand leadership to the voter whose proposals make up most of
    /// what the leader appends (see [`FOLLOW_MIN`]), so they skip the forward to the
    /// leader and their commits the hop back.
    pub follow_workload: bool,
    /// Capacity of the actor's inbox.
    pub inbox_capacity: usize,
    /// Capacity of the applied-event broadcast (slow subscribers see `Lagged`).
    pub event_capacity: usize,
    /// Where results carried in entries are stored as blobs (see [`CarriedStore`]).
    /// Without one they are dropped once applied: the record does not keep them, and
    /// they are gone from here when the log is compacted. A node always sets it.
    pub carried: Option<Arc<dyn CarriedStore>>,
}

impl ReplicaConfig {
    pub fn new(id: u64) -> Self {
        Self {
            id,
            tick_interval: Duration::from_millis(100),
            election_tick: 10,
            heartbeat_tick: 2,
            snapshot_interval: 50_000,
            snapshot_bytes: 64 << 20,
            log_retain: 1_000,
            log_retain_bytes: 4 << 20,
            proposal_timeout: Duration::from_secs(10),
            read_timeout: Duration::from_secs(5),
            auto_promote: true,
            follow_workload: true,
            inbox_capacity: 8192,
            event_capacity: 8192,
            carried: None,
        }
    }

    /// `limit` less this replica's share of it (up to an eighth, by its id).
    fn staggered(&self, limit: u64) -> u64 {
        limit - limit / 8 * (self.id % 1024) / 1024
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
            // The leader tells followers of a commit itself (see
            // [`Actor::tell_commit`]), only when one of them acts on it.
            skip_bcast_commit: true,
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
    /// Snapshots of this replica's own whose files could not be written (a full
    /// disk), since it started: each left the log whole until a later one.
    pub snapshot_write_failures: u64,
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
                | Outcome::ShardAssigned { .. }
                | Outcome::CallQueued { .. } => &self.applied,
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
    /// A snapshot from `from`, its state decoded off the replica's task: stepped
    /// now if it decoded (see [`Actor::on_raft_message`]).
    SnapshotChecked {
        from: u64,
        msg: Box<raft::eraftpb::Message>,
        state: Result<StateMachine>,
    },
}

/// The state machine as this replica has applied it, published: the replica alone
/// changes it, in place and between two of its steps, and readers borrow it through
/// [`ConsensusHandle::read_local`] without queueing behind the Ready loop. A `watch`
/// keeps one copy behind a read-write lock, so publishing costs no clone; readers
/// must not hold a borrow across an `.await`.
struct Published(watch::Sender<StateMachine>);

impl Published {
    fn get(&self) -> watch::Ref<'_, StateMachine> {
        self.0.borrow()
    }

    /// Changes the state and wakes those watching it. No borrow from [`Self::get`]
    /// may be alive on this thread meanwhile.
    fn change<R>(&self, f: impl FnOnce(&mut StateMachine) -> R) -> R {
        let mut out = None;
        self.0.send_modify(|state| out = Some(f(state)));
        out.expect("send_modify calls its closure once")
    }

    fn replace(&self, state: StateMachine) {
        self.0.send_replace(state);
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
    /// When it was made.
    made: Instant,
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
    state: Published,
    /// The conf state as of the applied index (goes into snapshots).
    conf_state: ConfState,
    transport: Arc<dyn Transport>,
    inbox: mpsc::Receiver<Msg>,
    events: broadcast::Sender<AppliedEvent>,
    status_tx: Option<watch::Sender<Status>>,
    /// Why the replica stopped on its own (a storage failure), once it has.
    failure: watch::Sender<Option<String>>,
    /// Entries whose carried result could not be stored when applied (a full
    /// disk): stored again every [`UNKEPT_RETRY_TICKS`] ticks until it is.
    unkept: BTreeSet<u64>,
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
    /// The leader as last seen; a change re-sends unplaced proposals at once.
    last_leader: u64,
    /// Since when this replica has known no leader (`None` while it knows one).
    leaderless_since: Option<Instant>,
    /// Leader-side: proposals appended since `workload_since`, by the replica that
    /// made them (this one's own included).
    workload: HashMap<u64, u64>,
    workload_since: Instant,
    /// When this replica last handed leadership on for the workload.
    followed_at: Option<Instant>,
    /// The last non-zero leader seen when publishing the status, and how many
    /// times it changed (see [`Status::leader_changes`]).
    known_leader: u64,
    leader_changes: u64,
    /// Leader-side: the commit index followers were last told of, or chose not to
    /// be (see [`Actor::tell_commit`]).
    told_commit: u64,
    /// Leader-side: indices of this leader's own entries whose commit only it acts
    /// on ([`Command::only_proposer_acts`]), oldest first.
    quiet: VecDeque<u64>,
    /// Fires once the file of the snapshot being stored is written (see
    /// [`RedbStorage::begin_compaction`]).
    compacting: Option<oneshot::Receiver<()>>,
    /// Snapshots of our own whose files could not be written, in a row, and when
    /// the next may be tried (see [`Actor::snapshot_stored`]).
    snapshot_failures: u32,
    snapshot_retry_at: Option<time::Instant>,
    /// All such failures since the replica started ([`Status::snapshot_write_failures`]).
    snapshot_failures_total: u64,
    /// The inbox, for what work done off the task hands back (weak: the replica
    /// stops once every handle is gone).
    myself: mpsc::WeakSender<Msg>,
    /// The state of the snapshot last received and stepped, decoded off the task,
    /// by its index and term: what [`Actor::restore`] installs.
    received: Option<(u64, u64, StateMachine)>,
}

/// Messages handled per round before the Ready is processed: large enough to batch
/// many proposals into one fsync, small enough to keep ticks on time.
const MAX_MSGS_PER_ROUND: usize = 4096;

/// A round of at most this many messages is a quiet one: its Ready is handled on
/// the replica's own task (see [`blocking`]). A lone call or task in a mesh of
/// three makes rounds of one or two (a proposal, an append, both followers'
/// answers); a loaded leader's rounds hold tens to thousands.
const QUIET_ROUND: usize = 3;

/// An append of more entries than this is persisted in [`blocking`] even in a
/// quiet round.
const INLINE_PERSIST_ENTRIES: usize = 1;
/// Nor is an append of more bytes than this persisted inline.
const INLINE_PERSIST_BYTES: usize = 1 << 20;

/// Runs `f`, which may block on the disk, telling a multi-threaded runtime so: the
/// worker's core, with its other tasks, moves to another thread meanwhile. Used
/// for a busy round's whole Ready, an append of many entries or bytes, and the
/// snapshots (taken, persisted, restored).
///
/// A quiet round's Ready (one entry appended and synced, an answer, an apply) runs
/// inline instead, the worker blocked for that one fsync. Handing the core over
/// costs more than that fsync there: it wakes another thread, and what the Ready
/// woke (the writer of an append's answer, the call waiting on its apply) waits
/// for a thread to pick it up, where inline it runs on this one as soon as the
/// replica's task yields. Under load the handover is worth it: the worker's other
/// tasks go on during the fsyncs. Measured (bench actors, then bench mesh; A/B
/// pairs in one session, alternating): a call's p50 through another node 1.20 /
/// 1.06 / 1.02 ms against 1.08 / 1.21 / 1.27 with every Ready handed over, at the
/// host 0.89 / 0.92 / 0.82 against 1.06 / 1.01 / 0.87; a trivial task's p50 0.75 /
/// 0.93 ms against 0.95 / 1.03, p99 1.18 / 1.26 against 1.67 / 1.36; tasks/s with
/// 64 in flight 5,129 / 4,579 against 5,236 / 4,538. Every Ready inline was as
/// quick for one call at a time but lost a quarter of the tasks/s (3,437 / 3,262 /
/// 4,230 against 5,751 / 4,449 / 5,402): three replicas' fsyncs held both workers
/// of the bench's process. A replica on a thread of its own (a single-threaded
/// runtime) was no quicker than handing over: every frame in and out then crosses
/// threads.
fn blocking<R>(f: impl FnOnce() -> R) -> R {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// Workload following (see [`ReplicaConfig::follow_workload`]): over each window of
/// [`FOLLOW_WINDOW`], a voter whose proposals were at least this many and three
/// quarters of all the leader appended, and that has nearly the whole log, becomes leader;
/// at most once per [`FOLLOW_COOLDOWN`] per replica, so leadership cannot swing
/// back and forth with a workload that does.
const FOLLOW_MIN: u64 = 50;
const FOLLOW_WINDOW: Duration = Duration::from_millis(250);
const FOLLOW_COOLDOWN: Duration = Duration::from_secs(30);
/// How far behind the leader's log a voter may be and still be handed leadership.
const FOLLOW_LAG: u64 = 256;

/// Unanswered ReadIndex requests remembered per replica (each retry adds one).
const MAX_READ_REQUESTS: usize = 16;

/// Election timeouts without a known leader after which proposals that could not be
/// sent are answered NoLeader before their deadline (each once it has waited one
/// election timeout itself). An election ends within two; a replica still without a
/// leader after three is cut off or without a majority.
const LEADERLESS_ELECTIONS: u32 = 3;

/// Ticks between tries to store the carried results that could not be stored
/// when applied.
const UNKEPT_RETRY_TICKS: u64 = 10;

/// Waits for the snapshot file being written, if any (else forever).
async fn written(compacting: &mut Option<oneshot::Receiver<()>>) {
    match compacting {
        Some(done) => {
            let _ = done.await;
        }
        None => std::future::pending().await,
    }
}

impl Actor {
    async fn run(mut self) {
        let mut ticker = time::interval(self.cfg.tick_interval);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut shutdown = None;
        // Apply what an earlier run committed but had not applied.
        if let Err(e) = self.drive() {
            self.stopped_by(e);
            return;
        }
        loop {
            let mut handled = 0usize;
            tokio::select! {
                biased;
                _ = ticker.tick() => self.on_tick(),
                () = written(&mut self.compacting) => {
                    if let Err(e) = self.snapshot_stored() {
                        self.stopped_by(e);
                        break;
                    }
                }
                msg = self.inbox.recv() => {
                    let Some(msg) = msg else { break };
                    if let Some(done) = self.handle(msg) {
                        shutdown = Some(done);
                        break;
                    }
                    handled = 1;
                    for _ in 0..MAX_MSGS_PER_ROUND {
                        let Ok(msg) = self.inbox.try_recv() else { break };
                        handled += 1;
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
            if let Err(e) = self.drive_round(handled) {
                // A storage failure leaves Raft unable to go on safely.
                self.stopped_by(e);
                break;
            }
            // A new leader (an election, a handover): the proposals waiting to be
            // placed go to it now, not at the next tick.
            if self.leader_changed() {
                self.flush_batch();
                if let Err(e) = self.drive_round(handled) {
                    self.stopped_by(e);
                    break;
                }
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

    /// Handles the Readies after a round of `handled` messages: inline when the
    /// round was quiet, else in [`blocking`].
    fn drive_round(&mut self, handled: usize) -> Result<()> {
        let driven = if handled <= QUIET_ROUND {
            self.drive()
        } else {
            blocking(|| self.drive())
        };
        // A snapshot stepped this round was restored in it, if raft-rs took it;
        // one it did not take is not held on to.
        self.received = None;
        driven
    }

    /// Stops on `e` (a storage failure: Raft cannot go on safely): logged, and
    /// told to whoever waits on [`ConsensusHandle::failed`].
    fn stopped_by(&self, e: ConsensusError) {
        error!(raft_id = self.cfg.id, "consensus stopped: {e}");
        self.failure.send_replace(Some(e.to_string()));
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
            Msg::SnapshotChecked { from, msg, state } => {
                self.on_snapshot_checked(from, *msg, state)
            }
        }
        None
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
            applied_index: self.state.get().applied_index(),
            first_index: store.first(),
            last_index: raft.raft_log.last_index(),
            snapshot_index: store.snapshot_metadata().index,
            voters,
            learners,
            pending_proposals: self.pending.len(),
            leader_changes: self.leader_changes,
            snapshot_write_failures: self.snapshot_failures_total,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replicas_stagger_their_snapshots_by_up_to_an_eighth() {
        let limits: Vec<u64> = [1u64, 2, 513, 1023, 1024 + 7]
            .iter()
            .map(|&id| ReplicaConfig::new(id).staggered(50_000))
            .collect();
        for l in &limits {
            assert!((43_750..=50_000).contains(l), "{l}");
        }
        let mut distinct = limits.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), limits.len(), "{limits:?}");
    }
}
