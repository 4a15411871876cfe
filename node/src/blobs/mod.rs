//! The blobs actor: this node's blob store and the moving of blobs between members.
//!
//! Owns the store (`store`) and the fetches under way: a blob wanted by several
//! callers at once (a worker's input, the API's output fetch, a peer's replicate
//! request) is pulled once, and every caller gets that pull's outcome. Second copies
//! are made by asking another member to pull the blob from this node.
//!
//! Talks to: the net actor (chunks from holders), the peers actor (who they are,
//! connections to them), consensus (the membership: every member may hold a blob).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use gpumesh_consensus::ConsensusHandle;
use gpumesh_protocol::{BlobId, ShardChanges};
use libp2p::PeerId;
use tokio::sync::{mpsc, oneshot};
use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;

use crate::error::{NodeError, Result};
use crate::net::NetHandle;
use crate::peers::{member_records, PeersHandle};
use crate::wire::{self, Changes, NextState, NodeReply, NodeRequest};

mod next_state;
mod pack;
mod recent;
pub mod repair;
pub mod store;
pub mod sweep;

pub use pack::{bench_compaction, CompactionReport, BENCH_AFTER, BENCH_APPEND};
pub use store::BlobStore;

/// How many rounds a fetch makes over every possible holder before giving up.
const FETCH_ROUNDS: u32 = 5;

/// Blobs stored here of at most this many bytes are read (and checked against their
/// hash) on the task that asks: such a file was usually written moments ago and is
/// in the page cache, and a hand-over to the blocking pool (a thread to wake, then
/// the task again) costs more than the read.
const READ_IN_PLACE_BYTES: u64 = 64 << 10;

/// How a pull ended, shared by everyone who waits for it: why it failed, if it did.
type Outcome = std::result::Result<(), String>;

enum BlobsMsg {
    Fetch {
        id: BlobId,
        holder: Option<PeerId>,
        respond_to: oneshot::Sender<Outcome>,
    },
}

/// The blobs actor's handle.
#[derive(Clone)]
pub struct BlobsHandle {
    store: BlobStore,
    tx: mpsc::Sender<BlobsMsg>,
    mover: Mover,
}

/// What a pull or a second copy needs; cloned into each fetch task.
#[derive(Clone)]
struct Mover {
    net: NetHandle,
    peers: PeersHandle,
    consensus: ConsensusHandle,
}

impl BlobsHandle {
    pub fn start(
        store: BlobStore,
        net: NetHandle,
        peers: PeersHandle,
        consensus: ConsensusHandle,
        cancel: CancellationToken,
    ) -> (Self, JoinHandle<()>) {
        let (tx, inbox) = mpsc::channel(256);
        let mover = Mover {
            net,
            peers,
            consensus,
        };
        let task = tokio::spawn(
            BlobsActor {
                store: store.clone(),
                mover: mover.clone(),
                inbox,
                fetching: HashMap::new(),
                pulls: JoinSet::new(),
                pulled: HashMap::new(),
                cancel,
            }
            .run(),
        );
        (Self { store, tx, mover }, task)
    }

    /// The store on this node's disk.
    pub fn store(&self) -> &BlobStore {
        &self.store
    }

    /// Makes blob `id` local, pulling it from `holder` first and then from every
    /// other member, connecting to them as needed. Concurrent fetches of one blob
    /// share one pull.
    pub async fn fetch(&self, id: BlobId, holder: Option<PeerId>) -> Outcome {
        if self.store.has(&id) {
            return Ok(());
        }
        let (respond_to, done) = oneshot::channel();
        self.tx
            .send(BlobsMsg::Fetch {
                id,
                holder,
                respond_to,
            })
            .await
            .map_err(|_| "the node is stopping".to_string())?;
        done.await.map_err(|_| "the node is stopping".to_string())?
    }

    /// The bytes of blob `id`, pulled from `holder` (or any member) if not local.
    /// From the holder named they come into memory only, checked against `id`:
    /// what wants them (a merge's inputs, an actor's state) needs them in hand,
    /// not on this disk, which may have no room for them. Failing that (the holder
    /// lost it, or is gone) they are fetched from any member and stored here.
    pub async fn pull(
        &self,
        id: BlobId,
        holder: Option<PeerId>,
    ) -> std::result::Result<Vec<u8>, String> {
        if let Some(from) = holder.filter(|_| !self.store.has(&id)) {
            match self.mover.net.pull_blob(from, id).await {
                Ok(bytes) => match checked(id, bytes).await {
                    Some(bytes) => return Ok(bytes),
                    None => tracing::debug!(%id, %from, "pulled bytes are not the blob's"),
                },
                Err(e) => tracing::debug!(%id, %from, "could not pull the blob: {e}"),
            }
        }
        self.fetch(id, holder).await?;
        self.read_local(id)
            .await
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("blob {id} vanished after it was fetched"))
    }

    /// The bytes of blob `id` if it is stored here: read on this task when small
    /// ([`READ_IN_PLACE_BYTES`]), else on the blocking pool.
    async fn read_local(&self, id: BlobId) -> Result<Option<Vec<u8>>> {
        let store = self.store.clone();
        if store.size(&id).is_some_and(|n| n <= READ_IN_PLACE_BYTES) {
            return store.get(&id);
        }
        tokio::task::spawn_blocking(move || store.get(&id))
            .await
            .map_err(|_| NodeError::Stopping)?
    }

    /// Stores `bytes` here (off the async runtime) and has one other member keep a
    /// copy; returns the blob's id. A small blob's bytes go to that member in the
    /// request ([`NodeRequest::Keep`]), and both write at once; a larger one (or one
    /// no member would take so) is pulled from here once stored.
    pub async fn put_and_copy(&self, bytes: Vec<u8>, prefer: Option<PeerId>) -> Result<BlobId> {
        let store = self.store.clone();
        if bytes.len() as u64 > store::SENT_MAX {
            // Hashed, then served from memory while it is written and synced here
            // and pulled by the member keeping the second copy, both at once.
            let bytes = Arc::new(bytes);
            let hashing = bytes.clone();
            let id = tokio::task::spawn_blocking(move || BlobId::of(&hashing))
                .await
                .map_err(|_| NodeError::Stopping)?;
            let staged = store.stage(id, bytes.clone());
            let here = tokio::task::spawn_blocking(move || store.put_hashed(id, &bytes));
            let (here, there) = tokio::join!(here, self.replicate(id, prefer));
            drop(staged);
            here.map_err(|_| NodeError::Stopping)??;
            there?;
            return Ok(id);
        }
        let id = BlobId::of(&bytes);
        let keep = NodeRequest::Keep {
            blob: id,
            bytes: bytes.clone(),
        };
        let here = tokio::task::spawn_blocking(move || store.put_hashed(id, &bytes));
        let (here, there) = tokio::join!(here, self.mover.copy_to_one(&keep, prefer));
        here.map_err(|_| NodeError::Stopping)??;
        if let Err(reason) = there {
            tracing::debug!(%id, %reason, "no member kept the blob from the request; one pulls it");
            self.copy_by_pull(id, prefer).await?;
        }
        Ok(id)
    }

    /// Answers another member's [`NodeRequest::Keep`]: stores `bytes` as blob `id`
    /// if they are its bytes and small enough to come that way.
    pub async fn keep(&self, id: BlobId, bytes: Vec<u8>) -> Outcome {
        let store = self.store.clone();
        tokio::task::spawn_blocking(move || store.put_sent(id, &bytes))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())
    }

    /// Has one other member keep a copy of `blob` (`prefer` first when it is another
    /// member, then every other member, connected ones first), so that losing this
    /// node afterwards loses nothing. Succeeds at once in a one-node mesh. Fails only
    /// when no other member can be reached or every one refused, and then says how
    /// many were reachable.
    /// Returns the member that kept the copy (`None` in a one-node mesh).
    ///
    /// A small blob (at most [`store::SENT_MAX`] bytes) goes to the member in the
    /// request ([`NodeRequest::Keep`]), as [`Self::put_and_copy`] sends one: one
    /// round trip, where a pull is the request, a stream opened back, the bytes and
    /// the answer. By pull, a task's new 16 KiB input took 0.59 ms to copy at its
    /// submit (median of 58).
    pub async fn replicate(&self, blob: BlobId, prefer: Option<PeerId>) -> Result<Option<PeerId>> {
        if self.store.size(&blob).is_some_and(|n| n <= store::SENT_MAX) {
            if let Ok(Some(bytes)) = self.read_local(blob).await {
                let keep = NodeRequest::Keep { blob, bytes };
                match self.mover.copy_to_one(&keep, prefer).await {
                    Ok(kept) => return Ok(kept),
                    Err(reason) => {
                        tracing::debug!(%blob, %reason, "no member kept the blob from the request; one pulls it");
                    }
                }
            }
        }
        self.copy_by_pull(blob, prefer).await
    }

    /// Has one other member pull a copy of `blob` from here (see [`Self::replicate`]).
    async fn copy_by_pull(&self, blob: BlobId, prefer: Option<PeerId>) -> Result<Option<PeerId>> {
        self.mover
            .copy_to_one(&NodeRequest::Replicate { blob }, prefer)
            .await
            .map_err(|reason| NodeError::NoSecondCopy { blob, reason })
    }

    /// Has `copies` other members hold blob `id`, stored here (every other member
    /// where the mesh has fewer): what a node leaving the mesh does with each blob
    /// the record names, so that the copy it held is not the one lost. A small blob
    /// goes in the request, a larger one is pulled from here. Returns how many
    /// members keep it.
    pub async fn hand_off(&self, id: BlobId, copies: usize) -> Result<usize> {
        let small = self.store.size(&id).is_some_and(|n| n <= store::SENT_MAX);
        let request = match small {
            true => match self.read_local(id).await? {
                Some(bytes) => NodeRequest::Keep { blob: id, bytes },
                None => NodeRequest::Replicate { blob: id },
            },
            false => NodeRequest::Replicate { blob: id },
        };
        self.mover
            .copy_to_many(&request, copies)
            .await
            .map(|kept| kept.len())
            .map_err(|reason| NodeError::NoSecondCopy { blob: id, reason })
    }

    /// Has two other members keep `bytes`, which this node's disk has no room for
    /// (a merge's outputs on a leader at its disk reserve): in the request when
    /// small, else pulled from here, where they are served from memory meanwhile.
    /// Returns the blob's id and one member that keeps it; fails unless two do, as
    /// a blob stored here and copied once would be on two nodes.
    pub async fn keep_elsewhere(&self, bytes: Vec<u8>) -> Result<(BlobId, PeerId)> {
        let bytes = Arc::new(bytes);
        let hashing = bytes.clone();
        let id = tokio::task::spawn_blocking(move || BlobId::of(&hashing))
            .await
            .map_err(|_| NodeError::Stopping)?;
        let request = if bytes.len() as u64 <= store::SENT_MAX {
            NodeRequest::Keep {
                blob: id,
                bytes: bytes.to_vec(),
            }
        } else {
            NodeRequest::Replicate { blob: id }
        };
        let _served = self.store.stage(id, bytes);
        let kept = self
            .mover
            .copy_to_many(&request, 2)
            .await
            .map_err(|reason| NodeError::NoSecondCopy { blob: id, reason })?;
        match kept[..] {
            [first, _, ..] => Ok((id, first)),
            _ => Err(NodeError::NoSecondCopy {
                blob: id,
                reason: format!(
                    "this node's disk is at its reserve, and {} other member(s) kept it: two \
                     copies are kept of every result",
                    kept.len()
                ),
            }),
        }
    }

    /// The blobs stored here that the record (as applied here) names: what a node
    /// leaving hands off, and what it checks for second copies once a member is lost.
    pub async fn named_here(&self) -> Result<Vec<BlobId>> {
        let named = self.mover.consensus.read_local(|s| s.blobs_in_use());
        let store = self.store.clone();
        let here = tokio::task::spawn_blocking(move || store.all_blobs())
            .await
            .map_err(|_| NodeError::Stopping)??;
        Ok(here.into_iter().filter(|b| named.contains(b)).collect())
    }

    /// Makes sure one other member holds blob `id`, stored here: the first other
    /// member asked pulls it from here unless it has it already. What each member
    /// does for its blobs once another member is removed (see [`repair`]).
    pub async fn ensure_copy(&self, id: BlobId) -> Result<usize> {
        self.mover
            .copy_to_many(&NodeRequest::Replicate { blob: id }, 1)
            .await
            .map(|kept| kept.len())
            .map_err(|reason| NodeError::NoSecondCopy { blob: id, reason })
    }

    /// Has one other member keep an actor's next state, sending only what the call
    /// changed (blob `changes`, stored here): `prefer` (the member that holds the
    /// state before the call) first. Every buffer's `base` and `next` blob must be
    /// stored here. Returns the member that kept it, like [`Self::replicate`].
    pub async fn advance(
        &self,
        changes: Changes,
        buffers: Vec<NextState>,
        prefer: Option<PeerId>,
    ) -> Result<Option<PeerId>> {
        let blob = buffers.first().map_or(BlobId::of(&[]), |b| b.next);
        self.mover
            .copy_to_one(&NodeRequest::Advance { changes, buffers }, prefer)
            .await
            .map_err(|reason| NodeError::NoSecondCopy { blob, reason })
    }

    /// Answers another member's [`NodeRequest::Advance`]: makes each buffer's next
    /// state from its base (kept here, or pulled from `from`) and the changes (pulled
    /// from `from`), checks it is the state `from` has, and stores it.
    pub async fn keep_next_state(
        &self,
        from: PeerId,
        changes: Changes,
        buffers: Vec<NextState>,
    ) -> Outcome {
        if buffers.iter().all(|b| self.store.has(&b.next)) {
            return Ok(());
        }
        let bytes = match changes {
            Changes::Whole => {
                for b in &buffers {
                    self.fetch(b.next, Some(from)).await?;
                }
                return Ok(());
            }
            Changes::Inline(bytes) => bytes,
            Changes::Blob(id) => {
                // Only `from` has them, in memory, for this alone: pulled into
                // memory and checked, never stored here.
                let bytes = self
                    .mover
                    .net
                    .pull_blob(from, id)
                    .await
                    .map_err(|e| format!("could not pull what the call changed: {e}"))?;
                // Not hashed here: the state made from them is checked against
                // the host's (see `next_state::keep`), and bytes that are not
                // what the host staged make a state that is not.
                bytes
            }
        };
        let changes = ShardChanges::decode(&bytes)
            .map_err(|e| format!("what the call changed does not decode: {e}"))?;
        for b in &buffers {
            if let Some(base) = b.base {
                self.fetch(base, Some(from)).await?;
            }
        }
        let store = self.store.clone();
        tokio::task::spawn_blocking(move || next_state::keep(&store, &changes, &buffers))
            .await
            .map_err(|e| e.to_string())?
    }
}

impl Mover {
    fn members(&self) -> Vec<PeerId> {
        member_records(&self.consensus)
            .into_iter()
            .map(|(p, _)| p)
            .collect()
    }

    async fn pull(&self, id: BlobId, holder: Option<PeerId>) -> Outcome {
        let me = self.peers.me();
        // What each member asked said in the last round it was asked.
        let mut asked: Vec<(PeerId, NodeError)> = Vec::new();
        for round in 0..FETCH_ROUNDS {
            // Every member is a possible holder; a node that just joined learns them
            // from the replicated membership, not only from its connections.
            let mut sources: Vec<PeerId> = holder.into_iter().collect();
            for p in self.members().into_iter().chain(self.peers.view().all()) {
                if !sources.contains(&p) && p != me {
                    sources.push(p);
                }
            }
            for &peer in &sources {
                match self.net.fetch_blob(peer, id).await {
                    Ok(()) => return Ok(()),
                    Err(e) => {
                        tracing::debug!(%peer, error = %e, "blob fetch failed");
                        asked.retain(|(p, _)| *p != peer);
                        asked.push((peer, e));
                    }
                }
            }
            // Maybe there is no connection to the holder yet: make them and try again.
            let connected = self.net.connected_peers();
            let missing: Vec<PeerId> = sources
                .iter()
                .copied()
                .filter(|p| !connected.contains(p))
                .collect();
            self.peers.connect(&connected, &missing).await;
            tokio::time::sleep(Duration::from_millis(100 << round)).await;
        }
        Err(self.nowhere(&asked))
    }

    /// Why no member handed a blob over, from what each one asked said: those
    /// that do not hold it, those that could not be reached, and any other answer,
    /// each member named by its Raft id as `gpumesh status` shows it.
    fn nowhere(&self, asked: &[(PeerId, NodeError)]) -> String {
        if asked.is_empty() {
            return "no other member to fetch it from".into();
        }
        let ids: HashMap<String, u64> = self.consensus.read_local(|s| {
            s.members()
                .iter()
                .map(|(id, m)| (m.peer_id.clone(), *id))
                .collect()
        });
        let name = |p: &PeerId| {
            let p = p.to_string();
            ids.get(&p).map_or(p, |id| format!("{id:x}"))
        };
        let (mut without, mut unreached, mut other) = (Vec::new(), Vec::new(), Vec::new());
        for (peer, e) in asked {
            match e {
                NodeError::BlobNotFound { .. } => without.push(name(peer)),
                NodeError::Unreached { .. } | NodeError::DialTimeout { .. } => {
                    unreached.push(name(peer))
                }
                e => other.push(format!("{}: {e}", name(peer))),
            }
        }
        let mut parts = Vec::new();
        if !unreached.is_empty() {
            parts.push(format!("could not reach {}", unreached.join(", ")));
        }
        if !without.is_empty() {
            parts.push(format!("not held by {}", without.join(", ")));
        }
        parts.extend(other);
        format!(
            "no member that was asked handed it over ({})",
            parts.join("; ")
        )
    }

    /// The other members to ask for a copy, `prefer` first (when it is one), then
    /// the rest, connected ones only; and how many other members there are. With no
    /// connection to any of them (this node just lost them, or is just back) it
    /// tries to reach them first.
    async fn targets(&self, prefer: Option<PeerId>) -> (usize, Vec<PeerId>) {
        let me = self.peers.me();
        let others: Vec<PeerId> = self.members().into_iter().filter(|p| *p != me).collect();
        if others.is_empty() {
            return (0, Vec::new());
        }
        let mut connected = self.net.connected_peers();
        let unconnected: Vec<PeerId> = others
            .iter()
            .copied()
            .filter(|p| !connected.contains(p))
            .collect();
        if unconnected.len() == others.len() {
            self.peers.connect(&connected, &unconnected).await;
            connected = self.net.connected_peers();
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
        // Members the record holds down last: one cut off without its connection
        // closing answers nothing until the request times out (30 s), which held a
        // merge that long after the leader was cut off by a partition.
        self.consensus.read_local(|s| {
            targets.sort_by_key(|p| s.down().contains(&crate::identity::raft_id(p)));
        });
        (others.len(), targets)
    }

    /// Asks one other member to keep a copy (`request` is a `Replicate` or an
    /// `Advance`): `prefer` first, then every other connected member.
    async fn copy_to_one(
        &self,
        request: &NodeRequest,
        prefer: Option<PeerId>,
    ) -> std::result::Result<Option<PeerId>, String> {
        let (n, targets) = self.targets(prefer).await;
        if n == 0 {
            return Ok(None);
        }
        let reachable = targets.len();
        let mut refusals = Vec::new();
        for peer in targets {
            match wire::call(&self.net, peer, request).await {
                Ok(NodeReply::Replicated) => return Ok(Some(peer)),
                Ok(NodeReply::Refused(why)) => refusals.push(format!("{peer}: {why}")),
                Ok(other) => refusals.push(format!("{peer}: unexpected answer {other:?}")),
                Err(e) => refusals.push(format!("{peer}: {e}")),
            }
        }
        Err(not_kept(n, reachable, &refusals))
    }

    /// Asks other members to keep a copy until `copies` of them have one (or every
    /// other member has, where there are fewer): `request` is a `Keep` or a
    /// `Replicate`, which a member that holds the blob already answers at once.
    /// Members the record holds down are not asked, nor counted: a copy there is
    /// out of reach. Returns the members that keep it.
    async fn copy_to_many(
        &self,
        request: &NodeRequest,
        copies: usize,
    ) -> std::result::Result<Vec<PeerId>, String> {
        let down = self.consensus.read_local(|s| s.down().clone());
        let up = |p: &PeerId| !down.contains(&crate::identity::raft_id(p));
        let (n, mut targets) = self.targets(None).await;
        let me = self.peers.me();
        let n = n - self
            .members()
            .iter()
            .filter(|p| **p != me && !up(p))
            .count()
            .min(n);
        targets.retain(up);
        let wanted = copies.min(n);
        let reachable = targets.len();
        let mut kept = Vec::new();
        let mut refusals = Vec::new();
        for peer in targets {
            if kept.len() == wanted {
                break;
            }
            match wire::call(&self.net, peer, request).await {
                Ok(NodeReply::Replicated) => kept.push(peer),
                Ok(NodeReply::Refused(why)) => refusals.push(format!("{peer}: {why}")),
                Ok(other) => refusals.push(format!("{peer}: unexpected answer {other:?}")),
                Err(e) => refusals.push(format!("{peer}: {e}")),
            }
        }
        if kept.len() < wanted {
            return Err(format!(
                "{} of the {wanted} copies wanted were kept: {}",
                kept.len(),
                not_kept(n, reachable, &refusals)
            ));
        }
        Ok(kept)
    }
}

/// `bytes` if they are blob `id`'s: hashed on this task when few, else on the
/// blocking pool.
async fn checked(id: BlobId, bytes: Vec<u8>) -> Option<Vec<u8>> {
    if bytes.len() as u64 <= READ_IN_PLACE_BYTES {
        return id.matches(&bytes).then_some(bytes);
    }
    tokio::task::spawn_blocking(move || id.matches(&bytes).then_some(bytes))
        .await
        .ok()
        .flatten()
}

/// Why no other member kept a copy: `n` others, `reachable` of them asked.
fn not_kept(n: usize, reachable: usize, refusals: &[String]) -> String {
    if reachable == 0 {
        format!("none of the {n} other member(s) of the mesh is reachable from this node")
    } else {
        format!(
            "{reachable} of the {n} other member(s) are reachable, and not enough kept a \
             copy ({})",
            refusals.join("; ")
        )
    }
}

struct BlobsActor {
    store: BlobStore,
    mover: Mover,
    inbox: mpsc::Receiver<BlobsMsg>,
    /// Blobs being pulled → who waits for each.
    fetching: HashMap<BlobId, Vec<oneshot::Sender<Outcome>>>,
    pulls: JoinSet<Outcome>,
    /// Which blob each pull is for: a pull that panicked still answers its waiters.
    pulled: HashMap<tokio::task::Id, BlobId>,
    cancel: CancellationToken,
}

impl BlobsActor {
    async fn run(mut self) {
        loop {
            tokio::select! {
                biased;
                _ = self.cancel.cancelled() => return,
                Some(done) = self.pulls.join_next_with_id(), if !self.pulls.is_empty() => {
                    let (task, outcome) = match done {
                        Ok((task, outcome)) => (task, outcome),
                        Err(e) => (e.id(), Err(format!("the blob fetch failed: {e}"))),
                    };
                    let Some(id) = self.pulled.remove(&task) else {
                        continue;
                    };
                    for waiter in self.fetching.remove(&id).unwrap_or_default() {
                        let _ = waiter.send(outcome.clone());
                    }
                }
                msg = self.inbox.recv() => match msg {
                    Some(BlobsMsg::Fetch { id, holder, respond_to }) => {
                        self.fetch(id, holder, respond_to)
                    }
                    None => return,
                },
            }
        }
    }

    fn fetch(&mut self, id: BlobId, holder: Option<PeerId>, respond_to: oneshot::Sender<Outcome>) {
        if self.store.has(&id) {
            let _ = respond_to.send(Ok(()));
            return;
        }
        if let Some(waiting) = self.fetching.get_mut(&id) {
            waiting.push(respond_to);
            return;
        }
        self.fetching.insert(id, vec![respond_to]);
        let mover = self.mover.clone();
        let pull = self
            .pulls
            .spawn(async move { mover.pull(id, holder).await });
        self.pulled.insert(pull.id(), id);
    }
}
