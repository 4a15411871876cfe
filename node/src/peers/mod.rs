//! The peers actor: who the other nodes are and where they listen.
//!
//! Owns the directory of raft id → peer id (a raft id is derived from a peer id, so
//! the way back has to be learned) and every peer's known listen addresses, from
//! identify, mDNS, membership records and other nodes' address books. It publishes
//! both as one immutable [`PeerView`] after each change, so the Raft transport can
//! look a peer up without waiting. Its handle dials (through the net actor) and
//! judges a peer whose connections closed.
//!
//! Talks to: the net actor (connections, dials, other nodes' address books). The
//! membership sweep (`sweep`) feeds it the members' records once consensus runs.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use libp2p::{Multiaddr, PeerId};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::identity;
use crate::net::NetHandle;
use crate::wire::{self, NodeReply, NodeRequest};

mod sweep;

pub use sweep::{keep_connected, member_records, record_mesh_addrs};

/// How long a peer whose connections closed may take to come back by itself before
/// this node tries to reach it.
const RECONNECT_GRACE: Duration = Duration::from_millis(100);

/// How long that one attempt to reach it may take.
const REACH_TIMEOUT: Duration = Duration::from_millis(500);

/// How long one dial of a member may take before the next address is tried.
const MEMBER_DIAL_TIMEOUT: Duration = Duration::from_secs(3);

/// What this node knows of its peers, as of one moment.
#[derive(Debug, Default)]
pub struct PeerView {
    ids: HashMap<u64, PeerId>,
    addrs: HashMap<PeerId, Vec<Multiaddr>>,
}

impl PeerView {
    /// The peer behind a raft id, once learned.
    pub fn peer(&self, raft_id: u64) -> Option<PeerId> {
        self.ids.get(&raft_id).copied()
    }

    /// Every peer this node has learned of (itself included).
    pub fn all(&self) -> Vec<PeerId> {
        self.ids.values().copied().collect()
    }

    /// Where `peer` is known to listen.
    pub fn addrs(&self, peer: &PeerId) -> &[Multiaddr] {
        self.addrs.get(peer).map(Vec::as_slice).unwrap_or_default()
    }

    /// The address book as handed to another node (`NodeRequest::Peers`).
    pub fn book(&self) -> Vec<(String, Vec<String>)> {
        self.addrs
            .iter()
            .map(|(p, a)| (p.to_string(), a.iter().map(|a| a.to_string()).collect()))
            .collect()
    }

    fn knows(&self, peer: &PeerId, addrs: &[Multiaddr]) -> bool {
        self.ids.contains_key(&identity::raft_id(peer))
            && addrs.iter().all(|a| self.addrs(peer).contains(a))
    }
}

enum PeersMsg {
    Learn {
        peers: Vec<(PeerId, Vec<Multiaddr>)>,
        respond_to: oneshot::Sender<()>,
    },
}

/// The peers actor's handle.
#[derive(Clone)]
pub struct PeersHandle {
    me: PeerId,
    tx: mpsc::Sender<PeersMsg>,
    view: watch::Receiver<Arc<PeerView>>,
    net: NetHandle,
}

impl std::fmt::Debug for PeersHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeersHandle").field("me", &self.me).finish()
    }
}

impl PeersHandle {
    /// Starts the actor; this node is in its directory from the start.
    pub fn start(net: NetHandle, cancel: CancellationToken) -> (Self, JoinHandle<()>) {
        let me = net.local_peer_id();
        let mut view = PeerView::default();
        view.ids.insert(identity::raft_id(&me), me);
        let (published, view) = watch::channel(Arc::new(view));
        let (tx, inbox) = mpsc::channel(256);
        let task = tokio::spawn(
            PeersActor {
                inbox,
                published,
                cancel,
            }
            .run(),
        );
        (Self { me, tx, view, net }, task)
    }

    /// This node's peer id.
    pub fn me(&self) -> PeerId {
        self.me
    }

    /// What is known now.
    pub fn view(&self) -> Arc<PeerView> {
        self.view.borrow().clone()
    }

    /// The peer behind a raft id, once learned.
    pub fn peer(&self, raft_id: u64) -> Option<PeerId> {
        self.view.borrow().peer(raft_id)
    }

    /// Records `peer` (and where it listens); returns its raft id once the view
    /// includes it, so a reply to it can be routed right after.
    pub async fn learn(&self, peer: PeerId, addrs: &[Multiaddr]) -> u64 {
        self.learn_all(vec![(peer, addrs.to_vec())]).await;
        identity::raft_id(&peer)
    }

    /// Records several peers at once.
    pub async fn learn_all(&self, mut peers: Vec<(PeerId, Vec<Multiaddr>)>) {
        {
            let view = self.view.borrow();
            peers.retain(|(p, a)| !view.knows(p, a));
        }
        if peers.is_empty() {
            return;
        }
        // The swarm learns them too, so anything that reaches a peer by its id (a
        // Raft or call stream to a member not connected yet) can dial it.
        for (peer, addrs) in &peers {
            if *peer == self.me {
                continue;
            }
            for a in addrs {
                let _ = self.net.add_address(*peer, a.clone()).await;
            }
        }
        let (respond_to, done) = oneshot::channel();
        if self
            .tx
            .send(PeersMsg::Learn { peers, respond_to })
            .await
            .is_ok()
        {
            let _ = done.await;
        }
    }

    /// Dials the given peers this node has no connection to, all at once, at every
    /// address known for each; asks the connected peers for their address books
    /// first when some of them have no known address. Returns those still not
    /// connected after every dial: none of their addresses took it.
    pub async fn connect(&self, connected: &[PeerId], missing: &[PeerId]) -> Vec<PeerId> {
        let unknown = {
            let view = self.view.borrow();
            missing.iter().any(|p| view.addrs(p).is_empty())
        };
        if unknown {
            for peer in connected {
                if let Ok(NodeReply::Peers(list)) =
                    wire::call(&self.net, *peer, &NodeRequest::Peers).await
                {
                    let learned = list
                        .into_iter()
                        .filter_map(|(p, addrs)| {
                            let p = p.parse::<PeerId>().ok()?;
                            Some((p, addrs.iter().filter_map(|a| a.parse().ok()).collect()))
                        })
                        .collect();
                    self.learn_all(learned).await;
                }
            }
        }
        let view = self.view();
        let mut dials = tokio::task::JoinSet::new();
        for &peer in missing {
            let addrs = view.addrs(&peer).to_vec();
            let net = self.net.clone();
            dials.spawn(async move {
                for addr in addrs {
                    let _ = net.add_address(peer, addr.clone()).await;
                    let with_id = match addr.iter().last() {
                        Some(libp2p::multiaddr::Protocol::P2p(_)) => addr,
                        _ => addr.with(libp2p::multiaddr::Protocol::P2p(peer)),
                    };
                    match tokio::time::timeout(MEMBER_DIAL_TIMEOUT, net.dial(with_id)).await {
                        Ok(Ok(_)) => return,
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "member dial failed"),
                        Err(_) => tracing::debug!(%peer, "member dial timed out"),
                    }
                }
            });
        }
        while dials.join_next().await.is_some() {}
        let now = self.net.connected_peers();
        missing
            .iter()
            .filter(|p| !now.contains(p))
            .copied()
            .collect()
    }

    /// After the last connection to `peer` closed: whether it stays gone — it does
    /// not come back by itself and cannot be dialled at any address known for it. A
    /// process that died refuses the dial at once, so the mesh learns of it in well
    /// under a second instead of waiting for it to fall silent.
    pub async fn confirm_lost(&self, peer: PeerId) -> bool {
        tokio::time::sleep(RECONNECT_GRACE).await;
        let connected = |list: &[PeerId]| list.contains(&peer);
        if connected(&self.net.connected_peers()) {
            return false;
        }
        let addrs = self.view().addrs(&peer).to_vec();
        for addr in addrs {
            let Ok(addr) = addr.with_p2p(peer) else {
                continue;
            };
            if let Ok(Ok(_)) = tokio::time::timeout(REACH_TIMEOUT, self.net.dial(addr)).await {
                return false;
            }
        }
        !connected(&self.net.connected_peers())
    }
}

struct PeersActor {
    inbox: mpsc::Receiver<PeersMsg>,
    published: watch::Sender<Arc<PeerView>>,
    cancel: CancellationToken,
}

impl PeersActor {
    async fn run(mut self) {
        loop {
            let msg = tokio::select! {
                biased;
                _ = self.cancel.cancelled() => return,
                msg = self.inbox.recv() => match msg { Some(m) => m, None => return },
            };
            match msg {
                PeersMsg::Learn { peers, respond_to } => {
                    self.learn(peers);
                    let _ = respond_to.send(());
                }
            }
        }
    }

    fn learn(&mut self, peers: Vec<(PeerId, Vec<Multiaddr>)>) {
        let current = self.published.borrow().clone();
        let mut ids = current.ids.clone();
        let mut book = current.addrs.clone();
        for (peer, addrs) in peers {
            ids.insert(identity::raft_id(&peer), peer);
            let known = book.entry(peer).or_default();
            for a in addrs {
                if !known.contains(&a) {
                    known.push(a);
                }
            }
        }
        self.published
            .send_replace(Arc::new(PeerView { ids, addrs: book }));
    }
}
