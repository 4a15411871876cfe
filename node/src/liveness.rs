//! Liveness: the one place that decides whether a member is alive.
//!
//! Owns, for this node: when it last applied an entry that a member proposed (its
//! own clock, at apply, so no two machines' clocks are compared) and which members
//! are unreachable (their connections closed and a dial was refused). From those
//! and one threshold, `down_after`, it publishes a [`LivenessView`] that the
//! scheduler (placement, reassignment), the API's status, the dashboard and the
//! metrics all read.
//!
//! Talks to: consensus (applied entries, the membership), and is told by the event
//! router when a peer becomes unreachable or connects again.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use gpumesh_consensus::{AppliedEvent, ConsensusHandle};
use serde::Serialize;
use tokio::sync::{broadcast, mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// The default for how long a member may be silent before it counts as down: four
/// missed heartbeats at the default interval of 2 s.
pub const DEFAULT_DOWN_AFTER: Duration = Duration::from_secs(8);
/// How often the view is recomputed when nothing else happens.
const REFRESH: Duration = Duration::from_millis(250);

/// How one member looks from this node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Presence {
    /// An entry it proposed was applied here within `down_after`.
    Alive,
    /// Nothing from it yet, and this node started less than `down_after` ago (it
    /// joined a moment ago): counted alive until then, but shown as not yet heard,
    /// not as alive.
    Unheard,
    /// Nothing from it for longer than `down_after` (it died, hangs, or is cut off
    /// without its connections closing).
    Silent,
    /// No connection to it, and it could not be dialled: its connections closed
    /// and it did not take a dial again, or it never took one since this node
    /// started.
    Unreachable,
}

/// What this node believes about every member, published after each change.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LivenessView {
    members: BTreeMap<u64, Presence>,
}

impl LivenessView {
    /// How `raft_id` looks; a member this node has not judged yet (it joined a
    /// moment ago) is [`Presence::Unheard`].
    pub fn presence(&self, raft_id: u64) -> Presence {
        self.members
            .get(&raft_id)
            .copied()
            .unwrap_or(Presence::Unheard)
    }

    /// Alive, or not yet heard within `down_after` of this node's start: what
    /// placement and repair count on.
    pub fn is_alive(&self, raft_id: u64) -> bool {
        matches!(self.presence(raft_id), Presence::Alive | Presence::Unheard)
    }

    /// Members that are not alive.
    pub fn down(&self) -> impl Iterator<Item = u64> + '_ {
        self.members
            .iter()
            .filter(|(_, p)| !matches!(p, Presence::Alive | Presence::Unheard))
            .map(|(id, _)| *id)
    }
}

enum LivenessMsg {
    Unreachable(u64),
    Reachable(u64),
}

/// The client of the liveness actor: report reachability, read the view.
#[derive(Clone)]
pub struct LivenessHandle {
    tx: mpsc::Sender<LivenessMsg>,
    view: watch::Receiver<Arc<LivenessView>>,
}

impl LivenessHandle {
    /// Starts judging the members of `consensus`'s record; `me` is never unreachable.
    pub fn start(
        me: u64,
        consensus: ConsensusHandle,
        down_after: Duration,
        cancel: CancellationToken,
    ) -> (LivenessHandle, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::channel(256);
        let (view_tx, view) = watch::channel(Arc::new(LivenessView::default()));
        let actor = LivenessActor {
            me,
            applied: consensus.subscribe(),
            consensus,
            down_after,
            started: Instant::now(),
            heard: HashMap::new(),
            unreachable: HashSet::new(),
            view: view_tx,
        };
        let task = tokio::spawn(actor.run(rx, cancel));
        (LivenessHandle { tx, view }, task)
    }

    /// The peer with `raft_id` closed its connections and cannot be dialled.
    pub async fn unreachable(&self, raft_id: u64) {
        let _ = self.tx.send(LivenessMsg::Unreachable(raft_id)).await;
    }

    /// The peer with `raft_id` is connected again. Never waits (the event router
    /// calls it): were the inbox full, the next connection event says it again.
    pub fn reachable(&self, raft_id: u64) {
        let _ = self.tx.try_send(LivenessMsg::Reachable(raft_id));
    }

    /// The latest view.
    pub fn view(&self) -> Arc<LivenessView> {
        self.view.borrow().clone()
    }

    /// A receiver that wakes on every change of the view.
    pub fn watch(&self) -> watch::Receiver<Arc<LivenessView>> {
        self.view.clone()
    }
}

struct LivenessActor {
    me: u64,
    consensus: ConsensusHandle,
    applied: broadcast::Receiver<AppliedEvent>,
    down_after: Duration,
    /// Members not heard from since this node started get the full threshold
    /// counted from here.
    started: Instant,
    heard: HashMap<u64, Instant>,
    unreachable: HashSet<u64>,
    view: watch::Sender<Arc<LivenessView>>,
}

impl LivenessActor {
    async fn run(mut self, mut inbox: mpsc::Receiver<LivenessMsg>, cancel: CancellationToken) {
        let mut refresh = tokio::time::interval(REFRESH);
        refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                _ = cancel.cancelled() => return,
                msg = inbox.recv() => match msg {
                    Some(LivenessMsg::Unreachable(id)) if id != self.me => {
                        self.unreachable.insert(id);
                    }
                    Some(LivenessMsg::Unreachable(_)) => continue,
                    Some(LivenessMsg::Reachable(id)) => {
                        self.unreachable.remove(&id);
                    }
                    None => return,
                },
                event = self.applied.recv() => match event {
                    Ok(AppliedEvent::Entry { entry, .. }) => {
                        self.heard.insert(entry.origin, Instant::now());
                        continue;
                    }
                    Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(broadcast::error::RecvError::Closed) => return,
                },
                _ = refresh.tick() => {}
            }
            self.publish().await;
        }
    }

    async fn publish(&mut self) {
        let members = self
            .consensus
            .read_local(|s| s.members().keys().copied().collect::<Vec<u64>>());
        let now = Instant::now();
        let view = LivenessView {
            members: members
                .into_iter()
                .map(|id| {
                    let heard = self.heard.get(&id).copied();
                    let last = heard.unwrap_or(self.started);
                    let presence = if self.unreachable.contains(&id) {
                        Presence::Unreachable
                    } else if now.duration_since(last) > self.down_after {
                        Presence::Silent
                    } else if heard.is_none() && id != self.me {
                        Presence::Unheard
                    } else {
                        Presence::Alive
                    };
                    (id, presence)
                })
                .collect(),
        };
        self.view.send_if_modified(|current| {
            if **current == view {
                false
            } else {
                *current = Arc::new(view);
                true
            }
        });
    }
}
