//! The event router: network events to their owners (Raft frames to the replica,
//! connections to liveness) and peers' node requests answered.

use super::*;

/// How long a peer whose connections closed may take to come back by itself before
/// this node tries to reach it.
pub(super) const RECONNECT_GRACE: Duration = Duration::from_millis(100);

/// How long that one attempt to reach it may take.
pub(super) const REACH_TIMEOUT: Duration = Duration::from_millis(500);

/// After the last connection to `peer` closed: if it does not come back and cannot
/// be dialled at any address known for it, it is unreachable. A process that died
/// refuses the dial at once, so the mesh learns of it in well under a second instead
/// of waiting for missed heartbeats; a peer that merely went quiet still is found by
/// the scheduler's heartbeat timeout.
pub(super) async fn confirm_lost(shared: Arc<Shared>, peer: PeerId) {
    tokio::time::sleep(RECONNECT_GRACE).await;
    let connected = |list: &[PeerId]| list.contains(&peer);
    if connected(&shared.net.connected_peers().await.unwrap_or_default()) {
        return;
    }
    let addrs = shared
        .addrs
        .read()
        .ok()
        .and_then(|book| book.get(&peer).cloned())
        .unwrap_or_default();
    for addr in addrs {
        let Ok(addr) = addr.with_p2p(peer) else {
            continue;
        };
        if let Ok(Ok(_)) = tokio::time::timeout(REACH_TIMEOUT, shared.net.dial(addr)).await {
            return;
        }
    }
    if connected(&shared.net.connected_peers().await.unwrap_or_default()) {
        return;
    }
    let id = shared.peers.insert(peer);
    tracing::info!(%peer, raft_id = id, "peer unreachable: its connections closed and it cannot be dialled");
    if let Some(liveness) = shared.liveness.get() {
        liveness.unreachable(id).await;
    }
    if let Some(c) = shared.consensus.get() {
        let _ = c.peer_unreachable(id).await;
    }
}

/// Routes network events: Raft frames to the replica, node requests to handlers.
pub(super) async fn dispatch(
    shared: Arc<Shared>,
    mut events: mpsc::Receiver<NetEvent>,
    cancel: CancellationToken,
) {
    loop {
        let event = tokio::select! {
            biased;
            _ = cancel.cancelled() => return,
            e = events.recv() => match e { Some(e) => e, None => return },
        };
        match event {
            NetEvent::Raft { from, frame } => {
                let id = shared.peers.insert(from);
                if let Some(c) = shared.consensus.get() {
                    if !c.try_receive(id, frame) {
                        tracing::debug!("raft inbox full; frame dropped (raft retries)");
                    }
                }
            }
            NetEvent::PeerConnected { peer, .. } => {
                let id = shared.peers.insert(peer);
                if let Some(liveness) = shared.liveness.get() {
                    liveness.reachable(id);
                }
            }
            NetEvent::PeerDiscovered { peer, addrs } => {
                shared.learn_addrs(peer, &addrs);
                for a in &addrs {
                    let _ = shared.net.add_address(peer, a.clone()).await;
                }
                let connected = shared.net.connected_peers().await.unwrap_or_default();
                if !connected.contains(&peer) {
                    if let Some(addr) = addrs.first() {
                        let net = shared.net.clone();
                        let addr = addr.clone();
                        tokio::spawn(async move {
                            let _ = net.dial(addr).await;
                        });
                    }
                }
            }
            NetEvent::PeerDisconnected(peer) => {
                tokio::spawn(confirm_lost(shared.clone(), peer));
            }
            NetEvent::Request {
                from,
                request,
                reply,
            } => {
                let shared = shared.clone();
                tokio::spawn(async move {
                    let answer = answer(&shared, from, request).await;
                    let _ = reply.send(answer);
                });
            }
        }
    }
}

pub(super) async fn answer(
    shared: &Arc<Shared>,
    from: PeerId,
    request: MeshRequest,
) -> MeshResponse {
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
    let reply = match request {
        NodeRequest::Hello => NodeReply::Hello {
            raft_id: shared.raft_id,
            cluster: match shared.consensus.get() {
                Some(_) => shared.cluster.get().map(|c| c.0),
                None => None,
            },
        },
        NodeRequest::Join { capability } => match shared.consensus.get() {
            None => NodeReply::Refused("this node is not in a mesh yet".into()),
            Some(c) => {
                let raft_id = shared.peers.insert(from);
                let known = c
                    .read_local(move |s| s.member(raft_id).is_some())
                    .await
                    .unwrap_or(false);
                if known {
                    NodeReply::Joined
                } else {
                    match c.add_learner(raft_id, from.to_string(), capability).await {
                        Ok(_) => NodeReply::Joined,
                        Err(e) => NodeReply::Refused(e.to_string()),
                    }
                }
            }
        },
        NodeRequest::Replicate { blob } => match shared.net.fetch_blob(from, blob).await {
            Ok(()) => NodeReply::Replicated,
            Err(e) => NodeReply::Refused(format!("could not copy blob {blob}: {e}")),
        },
        NodeRequest::Peers => NodeReply::Peers(
            shared
                .addrs
                .read()
                .map(|book| {
                    book.iter()
                        .map(|(p, a)| (p.to_string(), a.iter().map(|a| a.to_string()).collect()))
                        .collect()
                })
                .unwrap_or_default(),
        ),
    };
    match wire::encode(&reply) {
        Ok(bytes) => MeshResponse::Node(bytes),
        Err(e) => MeshResponse::Error(format!("could not encode the answer: {e}")),
    }
}
