//! A connection to every member: the sweep that follows the membership records,
//! dials every member this node is not connected to, and keeps the data dir's list
//! of where members listen (what `gpumesh ticket` hands out).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpumesh_consensus::{ConsensusHandle, StateMachine};
use libp2p::{Multiaddr, PeerId};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::PeersHandle;
use crate::identity;
use crate::liveness::LivenessHandle;

/// How often a node looks for members it has no connection to.
const MEMBER_SWEEP: Duration = Duration::from_millis(500);

/// How long a member's dials must have failed, sweep after sweep, before it is
/// unreachable: a node started with the others (a whole mesh restarted) is not
/// judged by a dial made before its listener was up.
const UNREACHABLE_AFTER: Duration = Duration::from_secs(1);

/// Every member's peer id and the addresses in its membership record, as this
/// replica has applied them.
pub fn member_records(consensus: &ConsensusHandle) -> Vec<(PeerId, Vec<Multiaddr>)> {
    consensus.read_local(|s| {
        s.members()
            .values()
            .filter_map(|m| {
                let peer = m.peer_id.parse::<PeerId>().ok()?;
                let addrs = m.addrs.iter().filter_map(|a| a.parse().ok()).collect();
                Some((peer, addrs))
            })
            .collect()
    })
}

/// Keeps the data dir's list of where members listen in step with the membership
/// records, this node's own addresses included before its record has them.
/// `recorded` is what was last written.
pub async fn record_mesh_addrs(
    peers: &PeersHandle,
    records: &[(PeerId, Vec<Multiaddr>)],
    data_dir: &Path,
    recorded: &mut Vec<Multiaddr>,
) {
    let me = peers.me();
    let mine = peers.net.listen_addrs().await.unwrap_or_default();
    let mut everyone: Vec<Multiaddr> = records
        .iter()
        .filter(|(peer, _)| *peer != me)
        .chain(std::iter::once(&(me, mine)))
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

/// Keeps a connection to every member: the peers' directory follows the membership
/// table, and every member this node is not connected to is dialled at the
/// addresses in its membership record (and any learned otherwise), whoever this node
/// bootstrapped from. So losing any one node, the seed included, leaves the others
/// connected.
///
/// A member no address of which has taken a dial for [`UNREACHABLE_AFTER`] is told
/// to `liveness` as unreachable, and one connected as reachable. Before, a node
/// that started while a member was down (killed, its machine off) showed it as not
/// heard yet for its first `down_after`, and counted it alive for placement all
/// that time: only a member whose connection closed was ever found unreachable.
pub async fn keep_connected(
    peers: PeersHandle,
    consensus: ConsensusHandle,
    liveness: LivenessHandle,
    data_dir: PathBuf,
    cancel: CancellationToken,
) {
    let me = peers.me();
    let mut recorded: Vec<Multiaddr> = Vec::new();
    // Members no dial has reached since: when the first failed.
    let mut failing: HashMap<PeerId, Instant> = HashMap::new();
    let mut state = consensus.watch_state();
    loop {
        let members: Vec<u64> = state
            .borrow_and_update()
            .members()
            .keys()
            .copied()
            .collect();
        let records = member_records(&consensus);
        record_mesh_addrs(&peers, &records, &data_dir, &mut recorded).await;
        let connected = peers.net.connected_peers();
        let missing: Vec<PeerId> = records
            .iter()
            .map(|(p, _)| *p)
            .filter(|p| *p != me && !connected.contains(p))
            .collect();
        peers.learn_all(records).await;
        // A connection to it now is the last word, whatever a dial that failed
        // while it was being made said.
        for peer in &connected {
            liveness.reachable(identity::raft_id(peer));
        }
        let unreached = match missing.is_empty() {
            true => Vec::new(),
            false => peers.connect(&connected, &missing).await,
        };
        let now = Instant::now();
        failing.retain(|p, _| unreached.contains(p));
        for peer in unreached {
            let since = *failing.entry(peer).or_insert(now);
            if now.duration_since(since) >= UNREACHABLE_AFTER {
                liveness.unreachable(identity::raft_id(&peer)).await;
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(MEMBER_SWEEP) => {}
            () = members_change(&mut state, &members) => {}
        }
    }
}

/// Returns once the applied membership is other than `members` (raft ids): a
/// member joined, or left. So a replica that has just applied a new member can
/// address its Raft frames to it at once, not at the next sweep. Before, a node
/// that joined and was handed leadership within the sweep could not reach the
/// members it had not yet learned (a bench's third node, for 0.37 s). Never, once
/// the replica is gone.
///
/// The state changes with every entry applied (thousands a second under load), so
/// it is looked at no more often than every [`MEMBERS_LOOK`]: the changes in
/// between wake it once.
async fn members_change(state: &mut watch::Receiver<StateMachine>, members: &[u64]) {
    loop {
        if state.changed().await.is_err() {
            return std::future::pending().await;
        }
        if !state.borrow_and_update().members().keys().eq(members) {
            return;
        }
        tokio::time::sleep(MEMBERS_LOOK).await;
    }
}

/// How often, at most, the sweep looks at the applied membership for a change.
const MEMBERS_LOOK: Duration = Duration::from_millis(20);
