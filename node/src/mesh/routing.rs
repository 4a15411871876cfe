//! The event router: network events to their owners (Raft frames to the replica,
//! connections to the peers actor and liveness) and peers' node requests answered.
//!
//! It runs from the start, before this node is a member: forming a mesh needs it to
//! answer other nodes' `Hello`s. Until [`Membership`] arrives it says it is in no
//! mesh yet, refuses to add nodes or keep copies, and drops Raft frames (Raft sends
//! them again).

use super::*;

/// Raft frames straight from the task that read them to the replica, skipping the
/// router, for peers the node already knows (the router learns the others first,
/// so that answers to them can be routed).
pub(super) fn raft_sink(consensus: ConsensusHandle, peers: PeersHandle) -> crate::net::RaftSink {
    Arc::new(move |from: PeerId, frame: Vec<u8>| {
        let id = identity::raft_id(&from);
        if peers.peer(id) != Some(from) {
            return Some(frame);
        }
        if !consensus.try_receive(id, frame) {
            tracing::debug!("raft inbox full; frame dropped (raft retries)");
        }
        None
    })
}

/// What the router serves once this node's replica runs.
pub(super) struct Membership {
    pub cluster: ClusterId,
    pub consensus: ConsensusHandle,
    pub liveness: LivenessHandle,
    pub blobs: BlobsHandle,
    /// The actor host's inbox for calls sent to it.
    pub calls: mpsc::Sender<crate::host::SentCall>,
}

pub(super) struct Router {
    pub raft_id: u64,
    pub net: NetHandle,
    pub peers: PeersHandle,
    pub events: mpsc::Receiver<NetEvent>,
    /// Sent once, when the replica starts.
    pub joined: oneshot::Receiver<Arc<Membership>>,
}

impl Router {
    pub async fn run(mut self, cancel: CancellationToken) {
        let mut member: Option<Arc<Membership>> = None;
        loop {
            let event = tokio::select! {
                biased;
                _ = cancel.cancelled() => return,
                m = &mut self.joined, if member.is_none() => match m {
                    Ok(m) => {
                        member = Some(m);
                        continue;
                    }
                    // The node stopped before its replica started.
                    Err(_) => return,
                },
                e = self.events.recv() => match e { Some(e) => e, None => return },
            };
            match event {
                NetEvent::Raft { from, frame } => {
                    let id = self.peers.learn(from, &[]).await;
                    if let Some(m) = &member {
                        if !m.consensus.try_receive(id, frame) {
                            tracing::debug!("raft inbox full; frame dropped (raft retries)");
                        }
                    }
                }
                NetEvent::PeerConnected { peer, .. } => {
                    let id = self.peers.learn(peer, &[]).await;
                    if let Some(m) = &member {
                        m.liveness.reachable(id);
                    }
                }
                NetEvent::PeerDiscovered { peer, addrs } => {
                    self.peers.learn(peer, &addrs).await;
                    for a in &addrs {
                        let _ = self.net.add_address(peer, a.clone()).await;
                    }
                    let connected = self.net.connected_peers();
                    if !connected.contains(&peer) {
                        if let Some(addr) = addrs.first() {
                            let net = self.net.clone();
                            let addr = addr.clone();
                            tokio::spawn(async move {
                                let _ = net.dial(addr).await;
                            });
                        }
                    }
                }
                NetEvent::PeerDisconnected(peer) => {
                    let (peers, member) = (self.peers.clone(), member.clone());
                    tokio::spawn(async move {
                        if !peers.confirm_lost(peer).await {
                            return;
                        }
                        let id = identity::raft_id(&peer);
                        tracing::info!(%peer, raft_id = id, "peer unreachable: its connections closed and it cannot be dialled");
                        if let Some(m) = member {
                            m.liveness.unreachable(id).await;
                            let _ = m.consensus.peer_unreachable(id).await;
                        }
                    });
                }
                NetEvent::Request {
                    from,
                    request,
                    reply,
                } => {
                    let answering = Answering {
                        raft_id: self.raft_id,
                        peers: self.peers.clone(),
                        member: member.clone(),
                    };
                    tokio::spawn(async move {
                        let _ = reply.send(answering.answer(from, request).await);
                    });
                }
            }
        }
    }
}

/// Node requests answered on the call lane's own task once this node is a member,
/// skipping the router (which still answers them before then).
pub(super) fn request_sink(
    raft_id: u64,
    peers: PeersHandle,
    member: Arc<Membership>,
) -> crate::net::RequestSink {
    Arc::new(move |from: PeerId, request: MeshRequest| {
        let answering = Answering {
            raft_id,
            peers: peers.clone(),
            member: Some(member.clone()),
        };
        Box::pin(answering.answer(from, request))
    })
}

/// What answering one node request needs.
struct Answering {
    raft_id: u64,
    peers: PeersHandle,
    member: Option<Arc<Membership>>,
}

impl Answering {
    async fn answer(self, from: PeerId, request: MeshRequest) -> MeshResponse {
        let MeshRequest::Node(bytes) = request else {
            return MeshResponse::Error("unsupported request".into());
        };
        let request = match wire::decode::<NodeRequest>(&bytes) {
            Ok(request) => request,
            Err(e) => {
                tracing::warn!(%from, error = %e, "malformed node request dropped");
                return MeshResponse::Error(format!("malformed node request: {e}"));
            }
        };
        let reply = match (request, &self.member) {
            (NodeRequest::Hello, m) => NodeReply::Hello {
                raft_id: self.raft_id,
                cluster: m.as_ref().map(|m| m.cluster.0),
            },
            (NodeRequest::Join { .. }, None) => {
                NodeReply::Refused("this node is not in a mesh yet".into())
            }
            (NodeRequest::Join { capability }, Some(m)) => {
                let raft_id = self.peers.learn(from, &[]).await;
                if m.consensus.read_local(move |s| s.member(raft_id).is_some()) {
                    NodeReply::Joined
                } else {
                    match m
                        .consensus
                        .add_learner(raft_id, from.to_string(), capability)
                        .await
                    {
                        Ok(_) => NodeReply::Joined,
                        Err(e) => NodeReply::Refused(e.to_string()),
                    }
                }
            }
            (NodeRequest::Replicate { blob }, None) => NodeReply::Refused(format!(
                "could not copy blob {blob}: this node is not in a mesh yet"
            )),
            (NodeRequest::Replicate { blob }, Some(m)) => {
                match m.blobs.fetch(blob, Some(from)).await {
                    Ok(()) => NodeReply::Replicated,
                    Err(e) => NodeReply::Refused(format!("could not copy blob {blob}: {e}")),
                }
            }
            (NodeRequest::Keep { blob, .. }, None) => NodeReply::Refused(format!(
                "could not keep blob {blob}: this node is not in a mesh yet"
            )),
            (NodeRequest::Keep { blob, bytes }, Some(m)) => match m.blobs.keep(blob, bytes).await {
                Ok(()) => NodeReply::Replicated,
                Err(e) => NodeReply::Refused(format!("could not keep blob {blob}: {e}")),
            },
            (NodeRequest::Advance { .. }, None) => {
                NodeReply::Refused("could not keep an actor's state: not in a mesh yet".into())
            }
            (NodeRequest::Advance { changes, buffers }, Some(m)) => {
                match m.blobs.keep_next_state(from, changes, buffers).await {
                    Ok(()) => NodeReply::Replicated,
                    Err(e) => NodeReply::Refused(format!("could not keep an actor's state: {e}")),
                }
            }
            (NodeRequest::Call { .. }, None) => {
                NodeReply::Refused("could not run an actor call: not in a mesh yet".into())
            }
            (
                NodeRequest::Call {
                    name,
                    call,
                    request,
                },
                Some(m),
            ) => NodeReply::Called(crate::host::ask(&m.calls, name, call, request, from).await),
            (NodeRequest::Peers, _) => NodeReply::Peers(self.peers.view().book()),
            (NodeRequest::Membership, None) => {
                NodeReply::Refused("this node is not in a mesh yet".into())
            }
            (NodeRequest::Membership, Some(m)) => {
                let asker = identity::raft_id(&from);
                let (applied, member) = m
                    .consensus
                    .read_local(move |s| (s.applied_index(), s.member(asker).is_some()));
                NodeReply::Membership {
                    cluster: m.cluster.0,
                    applied,
                    member,
                }
            }
        };
        match wire::encode(&reply) {
            Ok(bytes) => MeshResponse::Node(bytes),
            Err(e) => MeshResponse::Error(format!("could not encode the answer: {e}")),
        }
    }
}
