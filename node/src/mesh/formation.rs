//! Coming into a mesh: reopening a member's Raft storage, forming a new mesh
//! (`--init`, `--bootstrap-expect`), or finding a member and asking it to add this
//! node; and saying why, peer by peer, when none would.

use super::*;

/// Who is coming into a mesh: what forming or joining one needs of this node.
pub(super) struct Newcomer {
    pub net: NetHandle,
    pub peer_id: PeerId,
    pub raft_id: u64,
    pub capability: Option<NodeCapability>,
}

/// Opens the Raft storage of an existing member, or forms/joins a mesh. Returns the
/// storage, the mesh's id and, when joining, the peer to ask for membership once
/// Raft runs.
pub(super) async fn open_or_form(
    config: &NodeConfig,
    me: &Newcomer,
) -> Result<(RedbStorage, ClusterId, Option<PeerId>)> {
    let dir = &config.data_dir;
    super::leave::refuse_if_left(dir)?;
    let raft_path = dir.join("raft.redb");
    let cluster_path = dir.join(CLUSTER_FILE);
    if let Ok(text) = std::fs::read_to_string(&cluster_path) {
        let cluster =
            ClusterId(text.trim().parse().map_err(|_| {
                NodeError::Config(format!("{} is corrupt", cluster_path.display()))
            })?);
        let storage = RedbStorage::open(&raft_path, cluster)?;
        if storage.is_initialized() {
            return Ok((storage, cluster, None));
        }
        // Joined once but never received the mesh's state: join again.
        let peer = find_mesh(config, me, Some(cluster)).await?.1;
        return Ok((storage, cluster, Some(peer)));
    }
    let settings = ClusterSettings {
        max_voters: config.max_voters,
    };
    match config.formation {
        Formation::Init => {
            let cluster = ClusterId::derive(
                format!("{}:{:?}", me.peer_id, std::time::SystemTime::now()).as_bytes(),
            );
            let mut storage = RedbStorage::open(&raft_path, cluster)?;
            storage.initialize(&[(me.raft_id, me.peer_id.to_string())], settings)?;
            save_cluster(&cluster_path, cluster)?;
            Ok((storage, cluster, None))
        }
        Formation::BootstrapExpect(n) => {
            let deadline = Instant::now() + config.join_timeout;
            loop {
                let seen = hello_all(me).await;
                if let Some((peer, cluster)) = seen.iter().find_map(|(p, c)| c.map(|c| (*p, c))) {
                    // Someone formed it already: join.
                    let cluster = ClusterId(cluster);
                    let storage = RedbStorage::open(&raft_path, cluster)?;
                    save_cluster(&cluster_path, cluster)?;
                    return Ok((storage, cluster, Some(peer)));
                }
                let mut founders: Vec<(u64, String)> = seen
                    .iter()
                    .map(|(p, _)| (identity::raft_id(p), p.to_string()))
                    .chain([(me.raft_id, me.peer_id.to_string())])
                    .collect();
                founders.sort();
                founders.dedup();
                if founders.len() >= n {
                    founders.truncate(n);
                    if founders.iter().any(|(id, _)| *id == me.raft_id) {
                        let seed: String = founders
                            .iter()
                            .map(|(_, p)| p.as_str())
                            .collect::<Vec<_>>()
                            .join(",");
                        let cluster = ClusterId::derive(seed.as_bytes());
                        let mut storage = RedbStorage::open(&raft_path, cluster)?;
                        storage.initialize(&founders, settings)?;
                        save_cluster(&cluster_path, cluster)?;
                        return Ok((storage, cluster, None));
                    }
                }
                if Instant::now() > deadline {
                    return Err(NodeError::Config(format!(
                        "--bootstrap-expect {n}: saw only {} node(s) within {:?}; start the others or \
                         point --peer at them{}",
                        founders.len(),
                        config.join_timeout,
                        other_formats(&me.net)
                    )));
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        }
        Formation::Join => {
            let (cluster, peer) = find_mesh(config, me, None).await?;
            let storage = RedbStorage::open(&raft_path, cluster)?;
            save_cluster(&cluster_path, cluster)?;
            Ok((storage, cluster, Some(peer)))
        }
    }
}

pub(super) fn save_cluster(path: &std::path::Path, cluster: ClusterId) -> Result<()> {
    std::fs::write(path, cluster.0.to_string()).map_err(|e| NodeError::io(path, e))
}

/// Asks every connected peer which mesh it is in.
pub(super) async fn hello_all(me: &Newcomer) -> Vec<(PeerId, Option<u64>)> {
    let peers = me.net.connected_peers();
    let mut out = Vec::new();
    for peer in peers {
        match wire::call(&me.net, peer, &NodeRequest::Hello).await {
            Ok(NodeReply::Hello { cluster, .. }) => out.push((peer, cluster)),
            Ok(other) => tracing::debug!(%peer, ?other, "unexpected answer to hello"),
            Err(e) => tracing::debug!(%peer, error = %e, "no answer to hello"),
        }
    }
    out
}

/// Finds a member of a mesh (of `cluster`, if given) among the reachable peers.
pub(super) async fn find_mesh(
    config: &NodeConfig,
    me: &Newcomer,
    cluster: Option<ClusterId>,
) -> Result<(ClusterId, PeerId)> {
    let deadline = Instant::now() + config.join_timeout;
    loop {
        let seen = hello_all(me).await;
        for (peer, theirs) in &seen {
            match (theirs, cluster) {
                (Some(c), None) => return Ok((ClusterId(*c), *peer)),
                (Some(c), Some(mine)) if *c == mine.0 => return Ok((mine, *peer)),
                (Some(c), Some(mine)) => {
                    return Err(NodeError::Config(format!(
                    "this data dir ({}) belongs to mesh {:x}, but peer {peer} is in mesh {c:x}; \
                         use a fresh --data-dir to join that mesh",
                    config.data_dir.display(),
                    mine.0
                )))
                }
                (None, _) => {}
            }
        }
        if Instant::now() > deadline {
            if config.peers.is_empty() && seen.is_empty() {
                return Err(NodeError::Config(format!(
                    "found no mesh to join: give --peer ADDRESS of a member, or --init to start \
                     a new mesh{}",
                    other_formats(&me.net)
                )));
            }
            // Say why, peer by peer, when there are peers to ask.
            let mut why = Vec::new();
            for addr in &config.peers {
                why.push(probe(me, addr).await);
            }
            return Err(NodeError::Config(if why.is_empty() {
                format!(
                    "no mesh member answered within {:?}; check that a member runs and is \
                     reachable, or --init to start a new mesh",
                    config.join_timeout
                )
            } else {
                format!(
                    "no mesh member answered within {:?}: {}. A join ticket names the members \
                     its node knew when it was made (the first node's, made before the others \
                     joined, names that node alone); if they are gone, make a fresh one on any \
                     running member (`gpumesh ticket --data-dir ITS_DIR`: it names every \
                     member), or give --peer ADDRESS of one",
                    config.join_timeout,
                    why.join("; ")
                )
            }));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// How long the last look at a `--peer` that never let this node join may take.
pub(super) const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// One more attempt at a `--peer`, to say why joining through it failed: a refused or
/// failed handshake (wrong cluster key, nothing there), or a connection that the other
/// side closes as soon as it opens (this node is not on its allow-list).
pub(super) async fn probe(newcomer: &Newcomer, addr: &Multiaddr) -> String {
    let (me, net) = (newcomer.peer_id, &newcomer.net);
    let attempt = async {
        let peer = match net.dial(addr.clone()).await {
            Ok(peer) => peer,
            // Names the address and hints at the cluster key itself.
            Err(e) => return e.to_string(),
        };
        match wire::call(net, peer, &NodeRequest::Hello).await {
            Ok(NodeReply::Hello { cluster: None, .. }) => {
                format!("{addr} answered but is not in a mesh yet (start one node with --init)")
            }
            Ok(NodeReply::Hello {
                cluster: Some(_), ..
            }) => {
                format!("{addr} is a mesh member and answers now; try again")
            }
            Ok(other) => {
                format!("{addr} answered {other:?}; is it the same gpumesh version?")
            }
            Err(e) => match refusal(net, peer).await {
                Some(why) => format!(
                    "{addr} was refused: {why}; nodes of different data formats cannot share \
                     a mesh: run one gpumesh build on every node"
                ),
                None => unanswered(addr, me, e),
            },
        }
    };
    tokio::time::timeout(PROBE_TIMEOUT, attempt)
        .await
        .unwrap_or_else(|_| {
            format!(
                "{addr} did not complete a handshake within {PROBE_TIMEOUT:?}; check that it \
                 uses the same cluster key"
            )
        })
}

/// Why `peer` was refused for its data format, waiting a little for its identify
/// (which comes on its own stream, soon after the connection).
async fn refusal(net: &NetHandle, peer: PeerId) -> Option<String> {
    for _ in 0..20 {
        if let Some(why) = net.refusal(&peer) {
            return Some(why);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

/// The peers refused for their data format, as the end of a sentence ("" if none).
fn other_formats(net: &NetHandle) -> String {
    let refused = net.refusals();
    if refused.is_empty() {
        return String::new();
    }
    let each: Vec<String> = refused
        .iter()
        .map(|(peer, why)| format!("{peer}: {why}"))
        .collect();
    format!(
        "; refused as another data format (run one gpumesh build on every node): {}",
        each.join("; ")
    )
}

/// Why a `--peer` that took the connection did not answer the hello.
fn unanswered(addr: &Multiaddr, me: PeerId, e: NodeError) -> String {
    match e {
        e @ NodeError::Codec(_) => {
            format!("{addr} gave an unexpected answer ({e}); is it the same gpumesh version?")
        }
        e => format!(
            "{addr} accepted the connection, then closed it or did not answer ({e}); if \
                 that mesh admits only listed peers, add this node's peer id {me} to its \
                 members' --allow-peer"
        ),
    }
}

/// Asks `peer` to add us as a learner, retrying until it is committed.
pub(super) async fn join_through(me: &Newcomer, peer: PeerId, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let request = NodeRequest::Join {
        capability: me.capability.clone(),
    };
    loop {
        match wire::call(&me.net, peer, &request).await {
            Ok(NodeReply::Joined) => return Ok(()),
            Ok(NodeReply::Refused(why)) if Instant::now() > deadline => {
                return Err(NodeError::Config(format!(
                    "{peer} refused to add this node: {why}"
                )))
            }
            Err(e) if Instant::now() > deadline => {
                return Err(NodeError::Config(format!(
                    "could not join through {peer}: {e}"
                )))
            }
            _ => {}
        }
        if Instant::now() > deadline {
            return Err(NodeError::Config(format!(
                "{peer} did not add this node within {timeout:?}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}
