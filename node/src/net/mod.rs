//! The network actor: the one owner of the libp2p [`Swarm`].
//!
//! It owns the transport (TCP + Noise + Yamux; a closed mesh's cluster key is proven
//! inside the Noise handshake), one [`NetworkBehaviour`] (admission first: an optional allow-list of peer ids
//! and [`ConnectionCaps`]; then request-response for blob chunks; long-lived
//! streams for Raft, see [`raft_lane`], and for node requests (joins, calls sent to
//! an actor's host, copies asked of a peer), see [`call_lane`]; identify to learn peers'
//! listen addresses; mDNS when it can start), and the maps of
//! requests and dials still waiting for an answer. Everything else reaches the network
//! through a cloneable [`NetHandle`]; what arrives from peers leaves as [`NetEvent`]s
//! on one bounded channel to the node.
//!
//! Fault injection for tests of partitions: [`NetHandle::cut`] closes every
//! connection to a peer and refuses new ones both ways (a block list in the
//! behaviour, so the peer sees a real disconnect), [`NetHandle::mend`] undoes it, and
//! [`NetHandle::set_delay`] holds every outgoing Raft write and request back by a
//! fixed time.
//!
//! Whom it talks to:
//! - the node (raft, api): [`NetEvent::Raft`] frames and [`NetEvent::Request`]s for
//!   node requests, which the node answers through a oneshot;
//! - the [`BlobStore`]: it serves [`MeshRequest::BlobChunk`] itself, reading on the
//!   blocking pool, and [`NetHandle::fetch_blob`] pulls blobs into it.
//!
//! The actor never waits on the node: events go through an outbox it drains only when
//! the node has room, so a node that sends commands while it is slow to read events
//! cannot deadlock against it.
//!
//! It counts, in [`NetConfig::metrics`], the connected peers and the bytes of every
//! gpumesh frame it writes or reads whole (the codec and the Raft lane count them;
//! see [`crate::metrics`] for what that leaves out).
//!
//! - `config`: [`NetConfig`], [`ConnectionCaps`]; `events`: [`NetEvent`] and the
//!   handle's commands.
//! - `swarm`: transport, behaviour, listening, refusals put into words.
//! - `actor`: the loop that owns the swarm.
//! - `pull`: a blob pulled from a peer a window of chunks at a time.
//! - `codec`: request-response framing; `raft_lane`: long-lived Raft streams;
//!   `call_lane`: long-lived streams for node requests and their answers.
//! - `blob_direct`, `raft_direct`, `call_direct`: blob bytes, Raft frames and node
//!   requests on TCP connections of their own, sealed under keys sent on the mesh's
//!   authenticated streams.
//! - `bench`: the blob transfer benchmark behind `gpumesh bench mesh`.

mod actor;
mod bench;
mod blob_direct;
mod blob_lane;
mod call_direct;
mod call_lane;
mod codec;
mod config;
mod events;
mod pull;
mod raft_direct;
mod raft_lane;
mod swarm;

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use gpumesh_protocol::{MeshRequest, MeshResponse};
use libp2p::{Multiaddr, PeerId};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::blobs::store::BlobStore;
use crate::error::{NodeError, Result};

pub use bench::{
    bench_blob_transfer, bench_blob_transfer_with, blob_transfer_defaults, BlobRoute,
    BlobTransferReport,
};
pub use call_lane::CALL_PROTOCOL;
pub use codec::MESH_PROTOCOL;
pub use config::{ConnectionCaps, NetConfig};
pub use events::NetEvent;
pub use raft_lane::RAFT_PROTOCOL;

use events::Command;
pub use swarm::noise_prologue;
use swarm::{build_swarm, listen};

/// Commands waiting for the actor.
const COMMAND_QUEUE: usize = 1024;

/// Takes a Raft frame from a peer straight to the node's replica, on the task that
/// read it; gives the frame back when it is not for it to take (the node then gets
/// it as a [`NetEvent::Raft`]). See [`NetHandle::set_raft_sink`].
pub type RaftSink = Arc<dyn Fn(PeerId, Vec<u8>) -> Option<Vec<u8>> + Send + Sync>;

/// Answers a node request from a peer on the task that read it; see
/// [`NetHandle::set_request_sink`].
pub type RequestSink = Arc<
    dyn Fn(PeerId, MeshRequest) -> futures::future::BoxFuture<'static, MeshResponse> + Send + Sync,
>;

/// The node's way into the network; cheap to clone.
#[derive(Clone)]
pub struct NetHandle {
    commands: mpsc::Sender<Command>,
    raft: std::sync::Arc<raft_lane::RaftLane>,
    /// Node requests and their answers (see [`call_lane`]).
    calls: std::sync::Arc<call_lane::CallLane>,
    /// Opens blob-lane streams (see [`blob_lane`]); `None` when the lane is off.
    streams: Option<libp2p_stream::Control>,
    /// Where peers' direct blob ports are (see [`blob_direct`]); `None` when the
    /// direct channel is off.
    direct: Option<blob_direct::Peers>,
    /// Where the blob lane counts its bytes.
    metrics: crate::metrics::NetMetrics,
    local_peer_id: PeerId,
    blobs: BlobStore,
    chunk_bytes: u32,
    fetch_window: usize,
    /// See [`NetConfig::blob_open_ahead`].
    open_ahead: usize,
    /// Buffers of records pulled and done with, for the next pull's records.
    received: blob_direct::Spare,
    request_timeout: Duration,
    dial_timeout: Duration,
    /// Injected delay of every outgoing Raft write and request, in microseconds.
    delay_us: Arc<AtomicU64>,
    /// The peers connected now, as the actor last saw them.
    connected: raft_direct::PeerSet,
    /// Peers refused for their data format, and why.
    refused: OtherFormats,
}

/// Peers whose identify said they run another data format, and what it said; shared
/// by the network's actor (which writes) and its handles.
#[derive(Clone, Default)]
pub(crate) struct OtherFormats(Arc<std::sync::Mutex<HashMap<PeerId, String>>>);

impl OtherFormats {
    /// Records why `peer` was refused; true if that is news.
    fn insert(&self, peer: PeerId, why: String) -> bool {
        let mut map = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        map.insert(peer, why.clone()).as_ref() != Some(&why)
    }

    fn remove(&self, peer: &PeerId) {
        let mut map = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        map.remove(peer);
    }

    fn get(&self, peer: &PeerId) -> Option<String> {
        let map = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        map.get(peer).cloned()
    }

    fn all(&self) -> Vec<(PeerId, String)> {
        let map = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        map.iter().map(|(p, why)| (*p, why.clone())).collect()
    }
}

/// The next stream a peer opened on `incoming` (a lane's listener), or `None` once
/// `cancel` fires or the listener is gone.
async fn next_stream(
    incoming: &mut libp2p_stream::IncomingStreams,
    cancel: &CancellationToken,
) -> Option<(PeerId, libp2p::Stream)> {
    use futures::StreamExt;
    tokio::select! {
        _ = cancel.cancelled() => None,
        next = incoming.next() => next,
    }
}

/// The byte the serving side of a long-lived lane writes first: it took the stream.
/// libp2p drops a new inbound stream its acceptor has no room for yet (one slot, so
/// streams opened together lose); a stream is written to only once this arrives.
const READY: u8 = 0xA5;
/// How long to wait before opening again a stream the peer dropped unread.
const REOPEN_PAUSE: Duration = Duration::from_millis(5);

/// Opens a `protocol` stream to `peer` that the serving side has taken (it wrote
/// [`READY`]); opens another while the peer drops them. `lane` names it in the log.
async fn open_taken(
    control: &mut libp2p_stream::Control,
    peer: PeerId,
    protocol: libp2p::StreamProtocol,
    lane: &str,
) -> std::io::Result<libp2p::Stream> {
    use futures::AsyncReadExt;
    loop {
        let mut stream = control
            .open_stream(peer, protocol.clone())
            .await
            .map_err(std::io::Error::other)?;
        let mut ready = [0u8; 1];
        match stream.read_exact(&mut ready).await {
            Ok(()) if ready[0] == READY => return Ok(stream),
            Ok(()) => {
                return Err(std::io::Error::other(format!(
                    "the peer began the {lane} stream with {:#x}",
                    ready[0]
                )))
            }
            Err(e) => {
                tracing::debug!(%peer, "{lane} stream dropped by the peer before use: {e}");
                tokio::time::sleep(REOPEN_PAUSE).await;
            }
        }
    }
}

/// The serving side's first write on a lane's stream (see [`READY`]); false if the
/// stream is already gone.
async fn say_taken(stream: &mut (impl futures::AsyncWrite + Unpin)) -> bool {
    use futures::AsyncWriteExt;
    stream.write_all(&[READY]).await.is_ok() && stream.flush().await.is_ok()
}

impl fmt::Debug for NetHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NetHandle")
            .field("local_peer_id", &self.local_peer_id)
            .finish_non_exhaustive()
    }
}

impl NetHandle {
    /// Builds the swarm, starts listening (returns once every listen address is
    /// bound, so [`NetHandle::listen_addrs`] is complete), dials the bootstrap peers
    /// and spawns the actor. The actor stops when `cancel` fires or every handle is
    /// dropped; await the returned task to know it has.
    pub async fn start(
        config: NetConfig,
        blobs: BlobStore,
        events: mpsc::Sender<NetEvent>,
        cancel: CancellationToken,
    ) -> Result<(NetHandle, JoinHandle<()>)> {
        config.check()?;
        let mut swarm = build_swarm(&config)?;
        listen(&mut swarm, &config.listen).await?;
        let local_peer_id = *swarm.local_peer_id();
        let delay_us = Arc::new(AtomicU64::new(0));
        let direct = config.blob_lane && config.blob_direct;
        let cut = raft_direct::Cut::default();
        let sink = Arc::new(std::sync::OnceLock::new());
        let holder = match direct {
            true => {
                let inbound = raft_direct::Inbound {
                    to: raft_direct::Deliver {
                        events: events.clone(),
                        sink: sink.clone(),
                    },
                    max_frame: config.max_frame_bytes,
                    metrics: config.metrics.clone(),
                    cut: cut.clone(),
                };
                blob_direct::Holder::start(
                    &config.listen,
                    blobs.clone(),
                    Some(Arc::new(inbound)),
                    config.metrics.clone(),
                    cancel.clone(),
                )
                .await?
            }
            false => None,
        };
        let peers = blob_direct::Peers::default();
        let call_direct =
            call_lane::Direct::new(holder.clone(), direct.then(|| peers.clone()), cut.clone());
        let raft = raft_lane::RaftLane::start(
            swarm.behaviour().raft.new_control(),
            events.clone(),
            config.max_frame_bytes,
            delay_us.clone(),
            config.metrics.clone(),
            holder.clone(),
            direct.then(|| peers.clone()),
            cut,
            sink,
            cancel.clone(),
        )?;
        let calls = call_lane::CallLane::start(
            swarm.behaviour().raft.new_control(),
            events.clone(),
            config.max_frame_bytes,
            config.request_timeout.mul_f32(0.9),
            config.metrics.clone(),
            call_direct,
            cancel.clone(),
        )?;
        let mut streams = swarm.behaviour().raft.new_control();
        if config.blob_lane {
            blob_lane::serve(
                &mut streams,
                blobs.clone(),
                config.metrics.clone(),
                holder,
                cancel.clone(),
            )?;
        }
        let (commands_tx, commands) = mpsc::channel(COMMAND_QUEUE);
        let connected = raft_direct::PeerSet::default();
        let refused = OtherFormats::default();
        let task = actor::spawn(
            swarm,
            &config,
            commands,
            events,
            blobs.clone(),
            actor::Shared {
                direct: peers.clone(),
                connected: connected.clone(),
                refused: refused.clone(),
            },
            cancel,
        );
        let handle = NetHandle {
            commands: commands_tx,
            raft,
            calls,
            streams: config.blob_lane.then_some(streams),
            direct: direct.then_some(peers),
            metrics: config.metrics.clone(),
            local_peer_id,
            blobs,
            chunk_bytes: config.chunk_bytes,
            fetch_window: config.fetch_window,
            open_ahead: config.blob_open_ahead,
            received: blob_direct::Spare::default(),
            request_timeout: config.request_timeout,
            dial_timeout: config.dial_timeout,
            delay_us,
            connected,
            refused,
        };
        Ok((handle, task))
    }

    pub fn local_peer_id(&self) -> PeerId {
        self.local_peer_id
    }

    /// The addresses the node listens on (without `/p2p/`).
    pub async fn listen_addrs(&self) -> Result<Vec<Multiaddr>> {
        let (reply, rx) = oneshot::channel();
        self.command(Command::ListenAddrs(reply)).await?;
        rx.await.map_err(|_| NodeError::NetStopped)
    }

    /// Connects to `addr` (a trailing `/p2p/<peer id>` is checked if present) and
    /// returns the peer's id once the connection is up, or an error naming the
    /// address if it fails or does not complete within the dial timeout.
    pub async fn dial(&self, addr: Multiaddr) -> Result<PeerId> {
        let (reply, rx) = oneshot::channel();
        self.command(Command::Dial {
            addr: addr.clone(),
            reply,
        })
        .await?;
        match tokio::time::timeout(self.dial_timeout, rx).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(NodeError::NetStopped),
            Err(_) => Err(NodeError::DialTimeout {
                addr: addr.to_string(),
                secs: self.dial_timeout.as_secs_f64(),
            }),
        }
    }

    /// Queues one Raft frame for `to` without waiting: fire and forget, since Raft
    /// retries what gets lost. Fails at once if the peer's queue is full, the network
    /// has stopped, or the frame is over the frame limit.
    pub fn send_raft(&self, to: PeerId, frame: Vec<u8>) -> Result<()> {
        self.raft.send(to, frame)
    }

    /// From now on, node requests that arrive on the call lane are answered by
    /// `sink` on a task of their own rather than handed to the node as a
    /// [`NetEvent::Request`]: one task fewer woken for each. Set once.
    pub fn set_request_sink(&self, sink: RequestSink) {
        self.calls.set_sink(sink);
    }

    /// Peers this node's Raft frames go to over the direct channel (see
    /// [`raft_direct`]) rather than the mesh's streams.
    pub fn raft_direct_peers(&self) -> Vec<PeerId> {
        self.raft.direct_to.all()
    }

    /// Peers this node's node requests (calls to an actor's host, among others) go
    /// to over a direct connection (see [`call_direct`]) rather than the mesh's
    /// streams.
    pub fn call_direct_peers(&self) -> Vec<PeerId> {
        self.calls.direct_peers()
    }

    /// From now on, the Raft frames that arrive go to `sink` as they are read
    /// rather than through the node's events: one task fewer woken for each, on
    /// every commit's path. Set once; later calls change nothing.
    pub fn set_raft_sink(&self, sink: RaftSink) {
        let _ = self.raft.sink.set(sink);
    }

    /// Sends `request` to `to` (dialling it through known addresses if needed) and
    /// waits for the answer.
    pub async fn request(&self, to: PeerId, request: MeshRequest) -> Result<MeshResponse> {
        let delay = self.delay_us.load(Ordering::Relaxed);
        if delay > 0 {
            tokio::time::sleep(Duration::from_micros(delay)).await;
        }
        // This bound also covers a dial that hangs before the request is ever sent.
        let limit = self.request_timeout + self.dial_timeout;
        let answer = match request {
            MeshRequest::Node(body) => {
                tokio::time::timeout(limit, self.calls.request(to, body)).await
            }
            request => {
                let (reply, rx) = oneshot::channel();
                self.command(Command::Request { to, request, reply })
                    .await?;
                tokio::time::timeout(limit, async {
                    rx.await.unwrap_or(Err(NodeError::NetStopped))
                })
                .await
            }
        };
        match answer {
            Ok(result) => result,
            Err(_) => Err(NodeError::Request {
                peer: to.to_string(),
                reason: format!("no answer within {:.1}s", limit.as_secs_f64()),
            }),
        }
    }

    /// Peers with at least one open connection (none once the network stopped).
    /// Read here, without a turn of the network's actor: a blob's second copy
    /// and a call sent to an actor's host look first.
    pub fn connected_peers(&self) -> Vec<PeerId> {
        self.connected.all()
    }

    /// Why `peer` was refused, if its identify said it runs another data format
    /// (the connection is closed; every stream protocol's name carries the format,
    /// so nothing of either format would be read by the other).
    pub fn refusal(&self, peer: &PeerId) -> Option<String> {
        self.refused.get(peer)
    }

    /// Every peer refused for its data format, and why (see [`NetHandle::refusal`]).
    pub fn refusals(&self) -> Vec<(PeerId, String)> {
        self.refused.all()
    }

    /// Remembers an address of `peer` for later dials (e.g. from the membership table).
    /// Fault injection: closes every connection to `peer` and refuses new ones in
    /// both directions until [`NetHandle::mend`], as a network partition would.
    pub async fn cut(&self, peer: PeerId) -> Result<()> {
        self.raft.cut.set(peer, true);
        self.command(Command::Cut { peer, cut: true }).await
    }

    /// Undoes [`NetHandle::cut`]: connections to `peer` are allowed again.
    pub async fn mend(&self, peer: PeerId) -> Result<()> {
        self.raft.cut.set(peer, false);
        self.command(Command::Cut { peer, cut: false }).await
    }

    /// Fault injection: every outgoing Raft write and request waits `delay` first
    /// (zero, the default, for none), as a slow link would.
    pub fn set_delay(&self, delay: Duration) {
        self.delay_us.store(
            delay.as_micros().min(u64::MAX as u128) as u64,
            Ordering::Relaxed,
        );
    }

    pub async fn add_address(&self, peer: PeerId, addr: Multiaddr) -> Result<()> {
        self.command(Command::AddAddress { peer, addr }).await
    }

    async fn command(&self, command: Command) -> Result<()> {
        self.commands
            .send(command)
            .await
            .map_err(|_| NodeError::NetStopped)
    }
}
