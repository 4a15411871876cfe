//! Moving blobs between members: pulling one from whoever holds it, and having one
//! other member keep a second copy.

use super::*;

/// Makes blob `id` local, pulling it from `preferred` first and then from every
/// other known peer, connecting to them as needed.
pub(crate) async fn fetch_blob(
    shared: &Arc<Shared>,
    id: gpumesh_protocol::BlobId,
    preferred: Option<PeerId>,
) -> std::result::Result<(), String> {
    if shared.blobs.has(&id) {
        return Ok(());
    }
    let mut last = String::from("no peer to fetch it from");
    for round in 0..5 {
        // Every member is a possible holder; a node that just joined learns them
        // from the replicated membership, not only from its connections.
        if let Some(c) = shared.consensus.get() {
            for p in member_peers(c).await.unwrap_or_default() {
                shared.peers.insert(p);
            }
        }
        let mut sources: Vec<PeerId> = preferred.into_iter().collect();
        for p in shared.peers.all() {
            if !sources.contains(&p) && p != shared.peer_id {
                sources.push(p);
            }
        }
        for &peer in &sources {
            match shared.net.fetch_blob(peer, id).await {
                Ok(()) => return Ok(()),
                Err(e) => {
                    tracing::debug!(%peer, error = %e, "blob fetch failed");
                    last = e.to_string();
                }
            }
        }
        // Maybe we have no connection to the holder yet: make them and try again.
        let connected = shared.net.connected_peers().await.unwrap_or_default();
        let missing: Vec<PeerId> = sources
            .iter()
            .copied()
            .filter(|p| !connected.contains(p))
            .collect();
        connect_members(shared, &connected, &missing).await;
        tokio::time::sleep(Duration::from_millis(100 << round)).await;
    }
    Err(format!("blob {id} could not be fetched: {last}"))
}

/// Has one other member keep a copy of `blob` (the submitter first when it is
/// another node, then every other member, connected ones first), so that losing this
/// node after the result is recorded loses nothing. Succeeds at once in a one-node
/// mesh. Fails only when no other member can be reached or every one refused, and
/// then says how many were reachable.
pub(crate) async fn replicate(
    shared: &Arc<Shared>,
    blob: gpumesh_protocol::BlobId,
    prefer: Option<PeerId>,
) -> std::result::Result<(), String> {
    let members: Vec<PeerId> = match shared.consensus.get() {
        Some(c) => member_peers(c).await.unwrap_or_default(),
        None => Vec::new(),
    };
    let others: Vec<PeerId> = members
        .iter()
        .copied()
        .filter(|p| *p != shared.peer_id)
        .collect();
    if others.is_empty() {
        return Ok(());
    }
    let mut connected = shared.net.connected_peers().await.unwrap_or_default();
    let unconnected: Vec<PeerId> = others
        .iter()
        .copied()
        .filter(|p| !connected.contains(p))
        .collect();
    if unconnected.len() == others.len() {
        // No connection to any other member (this node just lost them, or is just
        // back): try to reach them before giving up.
        connect_members(shared, &connected, &unconnected).await;
        connected = shared.net.connected_peers().await.unwrap_or_default();
    }
    let mut targets: Vec<PeerId> = prefer
        .into_iter()
        .filter(|p| others.contains(p) && connected.contains(p))
        .collect();
    for p in &others {
        if connected.contains(p) && !targets.contains(p) {
            targets.push(*p);
        }
    }
    let reachable = targets.len();
    let mut refusals = Vec::new();
    for peer in targets {
        match wire::call(&shared.net, peer, &NodeRequest::Replicate { blob }).await {
            Ok(NodeReply::Replicated) => return Ok(()),
            Ok(NodeReply::Refused(why)) => refusals.push(format!("{peer}: {why}")),
            Ok(other) => refusals.push(format!("{peer}: unexpected answer {other:?}")),
            Err(e) => refusals.push(format!("{peer}: {e}")),
        }
    }
    let n = others.len();
    Err(if reachable == 0 {
        format!(
            "no second copy of blob {blob}: none of the {n} other member(s) of the mesh is \
             reachable from this node"
        )
    } else {
        format!(
            "no second copy of blob {blob}: {reachable} of the {n} other member(s) are \
             reachable, and none kept a copy ({})",
            refusals.join("; ")
        )
    })
}
