//! [`ConsensusHandle`]: the client of the consensus actor, what the rest of a node
//! holds.

use super::*;

/// A cheap, cloneable client of one replica.
#[derive(Clone)]
pub struct ConsensusHandle {
    id: u64,
    tx: mpsc::Sender<Msg>,
    events: broadcast::Sender<AppliedEvent>,
    status: watch::Receiver<Status>,
    state: watch::Receiver<StateMachine>,
    ids: Arc<RequestIds>,
    proposals: Arc<ProposalTally>,
    task: Arc<Mutex<Option<JoinHandle<()>>>>,
    failure: watch::Receiver<Option<String>>,
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
        let (published, state) = watch::channel(state);
        let (failure_tx, failure) = watch::channel(None);
        let mut actor = Actor {
            cluster,
            raw,
            state: Published(published),
            conf_state: snapshot_meta.get_conf_state().clone(),
            transport,
            inbox,
            events: events.clone(),
            status_tx: None,
            failure: failure_tx,
            unkept: BTreeSet::new(),
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
            leaderless_since: Some(Instant::now()),
            workload: HashMap::new(),
            workload_since: Instant::now(),
            followed_at: None,
            known_leader: 0,
            leader_changes: 0,
            told_commit: 0,
            quiet: VecDeque::new(),
            compacting: None,
            snapshot_failures: 0,
            snapshot_retry_at: None,
            snapshot_failures_total: 0,
            myself: tx.downgrade(),
            received: None,
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
            state,
            ids,
            proposals: Arc::default(),
            task: Arc::new(Mutex::new(Some(task))),
            failure,
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

    /// Reads this replica's state as applied so far, from the state it publishes
    /// after each apply: no message to the replica, no wait behind its writes. It
    /// may lag the leader by however far this replica lags (usually a heartbeat;
    /// unbounded if it is partitioned away). Use for dashboards, listings and
    /// plans that the log will judge again, not for decisions that must see every
    /// committed write ([`Self::read_linearizable`]). `f` must be quick: the replica
    /// waits for it before its next apply.
    pub fn read_local<R>(&self, f: impl FnOnce(&StateMachine) -> R) -> R {
        f(&self.state.borrow())
    }

    /// Wakes when this replica's applied state changes (see [`Self::read_local`]).
    pub fn watch_state(&self) -> watch::Receiver<StateMachine> {
        self.state.clone()
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

    /// Waits until the replica stops on its own, because its storage failed (a
    /// full disk, an I/O error): why. Never returns while it runs, or once it was
    /// stopped on purpose ([`Self::shutdown`], [`Self::kill`]).
    pub async fn failed(&self) -> String {
        let mut failure = self.failure.clone();
        let why = failure
            .wait_for(Option::is_some)
            .await
            .map(|why| why.clone().unwrap_or_default());
        match why {
            Ok(why) => why,
            Err(_) => std::future::pending().await,
        }
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

/// What a receiver of applied events got: an event, or a gap or the end.
pub type Received = std::result::Result<AppliedEvent, broadcast::error::RecvError>;

/// `first` (just received from `events`) and every event already waiting behind it,
/// in order: a follower of the log under load handles them as one batch (one pass,
/// one look at the state) instead of one at a time.
pub fn with_waiting(
    first: Received,
    events: &mut broadcast::Receiver<AppliedEvent>,
) -> Vec<Received> {
    let mut batch = vec![first];
    while !matches!(batch.last(), Some(Err(broadcast::error::RecvError::Closed))) {
        match events.try_recv() {
            Ok(e) => batch.push(Ok(e)),
            Err(broadcast::error::TryRecvError::Lagged(n)) => {
                batch.push(Err(broadcast::error::RecvError::Lagged(n)))
            }
            Err(broadcast::error::TryRecvError::Closed) => {
                batch.push(Err(broadcast::error::RecvError::Closed))
            }
            Err(broadcast::error::TryRecvError::Empty) => break,
        }
    }
    batch
}
