//! A connection to every member: where each listens (its membership record), the
//! sweep that dials those this node is not connected to, and this node's own
//! addresses published into its record and into the data dir for tickets.

use super::*;

/// The peer ids in this replica's membership table.
pub(super) async fn member_peers(consensus: &ConsensusHandle) -> Option<Vec<PeerId>> {
    Some(
        member_records(consensus)
            .await?
            .into_iter()
            .map(|(p, _)| p)
            .collect(),
    )
}

/// Every member's peer id and the addresses in its membership record.
pub(super) async fn member_records(
    consensus: &ConsensusHandle,
) -> Option<Vec<(PeerId, Vec<Multiaddr>)>> {
    consensus
        .read_local(|s| {
            s.members()
                .values()
                .filter_map(|m| {
                    let peer = m.peer_id.parse::<PeerId>().ok()?;
                    let addrs = m.addrs.iter().filter_map(|a| a.parse().ok()).collect();
                    Some((peer, addrs))
                })
                .collect()
        })
        .await
        .ok()
}

/// Keeps the data dir's list of where members listen (what `gpumesh ticket` hands
/// out) in step with the membership records, this node's own addresses included
/// before its record has them. `recorded` is what was last written.
pub(super) async fn record_mesh_addrs(
    shared: &Arc<Shared>,
    records: &[(PeerId, Vec<Multiaddr>)],
    data_dir: &std::path::Path,
    recorded: &mut Vec<Multiaddr>,
) {
    let mine = shared.net.listen_addrs().await.unwrap_or_default();
    let mut everyone: Vec<Multiaddr> = records
        .iter()
        .filter(|(peer, _)| *peer != shared.peer_id)
        .chain(std::iter::once(&(shared.peer_id, mine)))
        .flat_map(|(peer, addrs)| addrs.iter().filter_map(|a| a.clone().with_p2p(*peer).ok()))
        .collect();
    everyone.sort_by_key(|a| a.to_string());
    everyone.dedup();
    if everyone != *recorded && !everyone.is_empty() {
        match crate::admission::write_mesh_addrs(data_dir, &everyone) {
            Ok(()) => *recorded = everyone,
            Err(e) => tracing::warn!(error = %e, "could not record the members' addresses"),
        }
    }
}

/// How often a node looks for members it has no connection to.
pub(super) const MEMBER_SWEEP: Duration = Duration::from_millis(500);

/// Keeps a connection to every member: the peer book follows the membership table,
/// and every member this node is not connected to is dialled at the addresses in its
/// membership record (and any learned otherwise), whoever this node bootstrapped
/// from. So losing any one node, the seed included, leaves the others connected.
pub(super) async fn learn_members(
    shared: Arc<Shared>,
    data_dir: PathBuf,
    cancel: CancellationToken,
) {
    let Some(consensus) = shared.consensus.get().cloned() else {
        return;
    };
    let mut recorded: Vec<Multiaddr> = Vec::new();
    loop {
        if let Some(records) = member_records(&consensus).await {
            record_mesh_addrs(&shared, &records, &data_dir, &mut recorded).await;
            let connected = shared.net.connected_peers().await.unwrap_or_default();
            let mut missing = Vec::new();
            for (peer, addrs) in records {
                shared.peers.insert(peer);
                shared.learn_addrs(peer, &addrs);
                if peer != shared.peer_id && !connected.contains(&peer) {
                    missing.push(peer);
                }
            }
            if !missing.is_empty() {
                connect_members(&shared, &connected, &missing).await;
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(MEMBER_SWEEP) => {}
        }
    }
}

/// How long one dial of a member may take before the sweep moves on.
pub(super) const MEMBER_DIAL_TIMEOUT: Duration = Duration::from_secs(3);

/// Dials members this node has no connection to, all at once, at every address
/// known for each (its membership record, identify, mDNS); asks the connected peers
/// for their address books first when some member's addresses are unknown.
pub(super) async fn connect_members(
    shared: &Arc<Shared>,
    connected: &[PeerId],
    missing: &[PeerId],
) {
    let known = |p: &PeerId| {
        shared
            .addrs
            .read()
            .map(|b| b.get(p).is_some_and(|a| !a.is_empty()))
            .unwrap_or(false)
    };
    if missing.iter().any(|p| !known(p)) {
        for peer in connected {
            if let Ok(NodeReply::Peers(list)) =
                wire::call(&shared.net, *peer, &NodeRequest::Peers).await
            {
                for (p, addrs) in list {
                    if let Ok(p) = p.parse::<PeerId>() {
                        let addrs: Vec<Multiaddr> =
                            addrs.iter().filter_map(|a| a.parse().ok()).collect();
                        shared.learn_addrs(p, &addrs);
                    }
                }
            }
        }
    }
    let mut dials = tokio::task::JoinSet::new();
    for &peer in missing {
        let addrs = shared
            .addrs
            .read()
            .ok()
            .and_then(|b| b.get(&peer).cloned())
            .unwrap_or_default();
        let net = shared.net.clone();
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
}

/// Publishes where this node listens into its membership record when the record
/// says otherwise (a new member, or one restarted on other addresses).
pub(super) async fn publish_addrs(
    shared: &Arc<Shared>,
    consensus: &ConsensusHandle,
    recorded: &[String],
) {
    let Ok(mine) = shared.net.listen_addrs().await else {
        return;
    };
    let mut mine: Vec<String> = mine.iter().map(|a| a.to_string()).collect();
    // Loopback last: a peer on another machine reaching its own loopback finds
    // itself, not this node.
    mine.sort_by_key(|a| a.starts_with("/ip4/127.") || a.starts_with("/ip6/::1/"));
    if mine.is_empty() || mine == recorded {
        return;
    }
    let proposed = consensus
        .propose(Command::NodeAddresses {
            raft_id: shared.raft_id,
            addrs: mine,
        })
        .await;
    if let Err(e) = proposed {
        tracing::debug!(error = %e, "listen addresses not yet recorded");
    }
}
