//! The network actor: the one owner of the libp2p [`Swarm`].
//!
//! It owns the transport (TCP + Noise + Yamux, optionally behind a `pnet` cluster
//! key), one [`NetworkBehaviour`] (admission first: an optional allow-list of peer ids
//! and [`ConnectionCaps`]; then request-response for joins, node calls and blob
//! chunks; long-lived streams for Raft, see [`raft_lane`]; identify to learn peers'
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
//!   `Join` / `Node` requests, which the node answers through a oneshot;
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

mod bench;
mod codec;
mod raft_lane;

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::stream::{FuturesUnordered, StreamExt};
use gpumesh_protocol::{BlobId, MeshRequest, MeshResponse};
use libp2p::connection_limits::{self, ConnectionLimits};
use libp2p::core::muxing::StreamMuxerBox;
use libp2p::core::transport::{Boxed, ListenerId};
use libp2p::core::upgrade::Version;
use libp2p::identity::Keypair;
use libp2p::multiaddr::Protocol;
use libp2p::pnet::{PnetConfig, PreSharedKey};
use libp2p::request_response::{self, OutboundRequestId, ProtocolSupport, ResponseChannel};
use libp2p::swarm::behaviour::toggle::Toggle;
use libp2p::swarm::dial_opts::{DialOpts, PeerCondition};
use libp2p::swarm::{
    ConnectionDenied, ConnectionId, DialError, ListenError, NetworkBehaviour, SwarmEvent,
};
use libp2p::{
    allow_block_list, identify, mdns, noise, tcp, yamux, Multiaddr, PeerId, Swarm, SwarmBuilder,
    Transport,
};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::blobs::store::BlobStore;
use crate::error::{NodeError, Result};
use crate::metrics::NetMetrics;

pub use bench::{bench_blob_transfer, bench_blob_transfer_with, BlobTransferReport};
pub use codec::MESH_PROTOCOL;

/// Identify's protocol version: peers announcing anything else are not gpumesh nodes,
/// and their addresses are not remembered.
const IDENTIFY_PROTOCOL: &str = "/gpumesh/id/1";
/// Room for the envelope and the response's own fields around a chunk's bytes.
const FRAME_OVERHEAD: usize = 64;
/// Commands waiting for the actor.
const COMMAND_QUEUE: usize = 1024;
/// Events the node has not taken yet; beyond this, events are dropped and logged.
const OUTBOX_LIMIT: usize = 4096;
/// Answers computed off the actor (blob reads, node replies) on their way back to it.
const REPLY_QUEUE: usize = 256;
/// The longest a bootstrap peer that keeps failing waits between dials.
const MAX_REDIAL_BACKOFF: Duration = Duration::from_secs(60);

/// How a node joins the network. Start from [`NetConfig::new`] and change fields.
#[derive(Clone)]
pub struct NetConfig {
    /// The node's identity; its public key is the node's [`PeerId`].
    pub keypair: Keypair,
    /// Addresses to listen on, e.g. `/ip4/0.0.0.0/tcp/4001` (port 0 picks one).
    pub listen: Vec<Multiaddr>,
    /// Bootstrap peers, dialled at start and redialled with backoff while not
    /// connected. A trailing `/p2p/<peer id>` is optional.
    pub peers: Vec<Multiaddr>,
    /// Discover peers on the LAN with mDNS. If it cannot start (common in containers)
    /// the node logs a warning and works with `peers` alone.
    pub mdns: bool,
    /// The cluster key: only nodes holding the same key can connect at all.
    pub psk: Option<PreSharedKey>,
    /// When not empty, the only peers this node keeps connections with, both ways:
    /// any other peer is disconnected as soon as Noise has authenticated its id.
    pub allow_peers: Vec<PeerId>,
    /// How many connections peers may hold open or half-open.
    pub connections: ConnectionCaps,
    /// The largest frame (one request or response) accepted or sent.
    pub max_frame_bytes: usize,
    /// Bytes asked for per blob chunk request.
    pub chunk_bytes: u32,
    /// Chunk requests kept in flight by one blob fetch.
    pub fetch_window: usize,
    /// How long one request may take before it fails.
    pub request_timeout: Duration,
    /// How long a dial may take (TCP connect + handshakes) before it fails.
    pub dial_timeout: Duration,
    /// How long a connection with no open stream stays up. Generous, so that the
    /// pauses between Raft messages do not churn connections.
    pub idle_timeout: Duration,
    /// The first wait before redialling a bootstrap peer; doubles on each failure.
    pub redial_interval: Duration,
    /// Where the bytes sent and received (per lane) and the connected peers are
    /// counted; the default counts into no registry.
    pub metrics: NetMetrics,
}

impl NetConfig {
    /// Defaults tuned on loopback (see [`bench_blob_transfer`]); listens nowhere and
    /// dials nobody until `listen` / `peers` are set.
    pub fn new(keypair: Keypair) -> Self {
        NetConfig {
            keypair,
            listen: Vec::new(),
            peers: Vec::new(),
            mdns: true,
            psk: None,
            allow_peers: Vec::new(),
            connections: ConnectionCaps::default(),
            max_frame_bytes: 32 << 20,
            chunk_bytes: 1 << 20,
            fetch_window: 8,
            request_timeout: Duration::from_secs(30),
            dial_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(300),
            redial_interval: Duration::from_secs(2),
            metrics: NetMetrics::default(),
        }
    }

    fn check(&self) -> Result<()> {
        let fail = |what: String| Err(NodeError::NetSetup(what));
        if self.chunk_bytes == 0 || self.fetch_window == 0 {
            return fail("chunk_bytes and fetch_window must be at least 1".into());
        }
        self.connections.check()?;
        if self.max_frame_bytes > gpumesh_protocol::codec::MAX_MESSAGE_BYTES {
            return fail(format!(
                "max_frame_bytes {} is over the codec limit of {}",
                self.max_frame_bytes,
                gpumesh_protocol::codec::MAX_MESSAGE_BYTES
            ));
        }
        if self.chunk_bytes as usize + FRAME_OVERHEAD > self.max_frame_bytes {
            return fail(format!(
                "chunk_bytes {} does not fit in max_frame_bytes {}",
                self.chunk_bytes, self.max_frame_bytes
            ));
        }
        Ok(())
    }
}

// By hand: the keypair and the cluster key are secrets and stay out of logs.
impl fmt::Debug for NetConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NetConfig")
            .field("peer_id", &self.keypair.public().to_peer_id())
            .field("listen", &self.listen)
            .field("peers", &self.peers)
            .field("mdns", &self.mdns)
            .field("psk", &self.psk.map(|k| k.fingerprint().to_string()))
            .field("allow_peers", &self.allow_peers)
            .field("connections", &self.connections)
            .field("max_frame_bytes", &self.max_frame_bytes)
            .field("chunk_bytes", &self.chunk_bytes)
            .field("fetch_window", &self.fetch_window)
            .field("request_timeout", &self.request_timeout)
            .field("dial_timeout", &self.dial_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .finish()
    }
}

/// Caps on connections, enforced by libp2p's `connection_limits` behaviour: a
/// connection over a cap is closed as soon as it is counted, and the node carries on
/// with the ones it has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectionCaps {
    /// Established connections with any one peer. Two nodes need one, sometimes two
    /// (both dialled at once); more is a misbehaving or looping peer.
    pub per_peer: u32,
    /// Established connections in all, with every peer.
    pub total: u32,
    /// Incoming connections still in their handshakes (pnet, Noise, Yamux): bounds
    /// what a flood of half-open connections can cost.
    pub pending_incoming: u32,
}

impl Default for ConnectionCaps {
    fn default() -> Self {
        ConnectionCaps {
            per_peer: 8,
            total: 256,
            pending_incoming: 64,
        }
    }
}

impl ConnectionCaps {
    fn check(&self) -> Result<()> {
        if self.per_peer == 0 || self.total == 0 || self.pending_incoming == 0 {
            return Err(NodeError::NetSetup(format!(
                "connection limits must be at least 1 (got {self:?}): a node that \
                 accepts no connection cannot be in a mesh"
            )));
        }
        Ok(())
    }

    fn limits(&self) -> ConnectionLimits {
        ConnectionLimits::default()
            .with_max_established_per_peer(Some(self.per_peer))
            .with_max_established(Some(self.total))
            .with_max_pending_incoming(Some(self.pending_incoming))
    }
}

/// What the network tells the node.
#[derive(Debug)]
pub enum NetEvent {
    /// A Raft frame from `from`, read off its Raft stream.
    Raft { from: PeerId, frame: Vec<u8> },
    /// A `Join` or `Node` request; send the answer on `reply` within the request
    /// timeout. Dropping `reply` answers the peer with an error.
    Request {
        from: PeerId,
        request: MeshRequest,
        reply: oneshot::Sender<MeshResponse>,
    },
    /// The first connection to `peer` is up; `addr` is its remote address.
    PeerConnected { peer: PeerId, addr: Multiaddr },
    /// The last connection to the peer closed.
    PeerDisconnected(PeerId),
    /// Addresses of a gpumesh peer learned from mDNS or identify. The net actor
    /// remembers them for later dials but does not dial by itself: the node decides.
    PeerDiscovered { peer: PeerId, addrs: Vec<Multiaddr> },
}

enum Command {
    ListenAddrs(oneshot::Sender<Vec<Multiaddr>>),
    Dial {
        addr: Multiaddr,
        reply: oneshot::Sender<Result<PeerId>>,
    },
    Request {
        to: PeerId,
        request: MeshRequest,
        reply: oneshot::Sender<Result<MeshResponse>>,
    },
    ConnectedPeers(oneshot::Sender<Vec<PeerId>>),
    AddAddress {
        peer: PeerId,
        addr: Multiaddr,
    },
    Cut {
        peer: PeerId,
        cut: bool,
    },
}

/// The node's way into the network; cheap to clone.
#[derive(Clone)]
pub struct NetHandle {
    commands: mpsc::Sender<Command>,
    raft: std::sync::Arc<raft_lane::RaftLane>,
    local_peer_id: PeerId,
    blobs: BlobStore,
    chunk_bytes: u32,
    fetch_window: usize,
    request_timeout: Duration,
    dial_timeout: Duration,
    /// Injected delay of every outgoing Raft write and request, in microseconds.
    delay_us: Arc<AtomicU64>,
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
        let raft = raft_lane::RaftLane::start(
            swarm.behaviour().raft.new_control(),
            events.clone(),
            config.max_frame_bytes,
            delay_us.clone(),
            config.metrics.clone(),
            cancel.clone(),
        )?;
        let (commands_tx, commands) = mpsc::channel(COMMAND_QUEUE);
        let (replies_tx, replies) = mpsc::channel(REPLY_QUEUE);
        let bootstrap = config
            .peers
            .iter()
            .map(|addr| Bootstrap {
                addr: addr.clone(),
                peer: peer_of(addr),
                dialing: None,
                failures: 0,
                next_try: Instant::now(),
            })
            .collect();
        let actor = NetActor {
            swarm,
            commands,
            events,
            outbox: VecDeque::new(),
            replies_tx,
            replies,
            blobs: blobs.clone(),
            pending_requests: HashMap::new(),
            pending_dials: HashMap::new(),
            bootstrap,
            // Leave the peer some of its own timeout to get our error answer back.
            node_answer_timeout: config.request_timeout.mul_f32(0.9),
            max_chunk: (config.max_frame_bytes - FRAME_OVERHEAD) as u32,
            redial_interval: config.redial_interval,
            metrics: config.metrics.clone(),
        };
        let task = tokio::spawn(actor.run(cancel));
        let handle = NetHandle {
            commands: commands_tx,
            raft,
            local_peer_id,
            blobs,
            chunk_bytes: config.chunk_bytes,
            fetch_window: config.fetch_window,
            request_timeout: config.request_timeout,
            dial_timeout: config.dial_timeout,
            delay_us,
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

    /// Sends `request` to `to` (dialling it through known addresses if needed) and
    /// waits for the answer.
    pub async fn request(&self, to: PeerId, request: MeshRequest) -> Result<MeshResponse> {
        let delay = self.delay_us.load(Ordering::Relaxed);
        if delay > 0 {
            tokio::time::sleep(Duration::from_micros(delay)).await;
        }
        let (reply, rx) = oneshot::channel();
        self.command(Command::Request { to, request, reply })
            .await?;
        // request-response times the exchange itself; this bound also covers a dial
        // that hangs before the request is ever sent.
        let limit = self.request_timeout + self.dial_timeout;
        match tokio::time::timeout(limit, rx).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(NodeError::NetStopped),
            Err(_) => Err(NodeError::Request {
                peer: to.to_string(),
                reason: format!("no answer within {:.1}s", limit.as_secs_f64()),
            }),
        }
    }

    /// Pulls blob `id` from peer `from` into the blob store, checking it against its
    /// id. A no-op if the blob is already here.
    pub async fn fetch_blob(&self, from: PeerId, id: BlobId) -> Result<()> {
        if self.blobs.has(&id) {
            return Ok(());
        }
        let bytes = self.pull_blob(from, id).await?;
        let blobs = self.blobs.clone();
        tokio::task::spawn_blocking(move || blobs.put_verified(id, &bytes))
            .await
            .map_err(|e| NodeError::NetSetup(format!("blob store task failed: {e}")))?
    }

    /// The blob's bytes from `from`, assembled from chunks with `fetch_window`
    /// requests in flight, so the link stays busy while each answer is on its way. Not
    /// yet checked against `id`.
    pub(crate) async fn pull_blob(&self, from: PeerId, id: BlobId) -> Result<Vec<u8>> {
        let chunk = u64::from(self.chunk_bytes);
        let first = self.blob_chunk(from, id, 0, chunk).await?;
        let total = first.total;
        let limit = self.blobs.max_blob_bytes();
        if total > limit {
            return Err(NodeError::Limit {
                what: "blob size in bytes (as announced by the peer)",
                value: total,
                limit,
                setting: "--max-blob-bytes",
            });
        }
        let mut out = vec![0u8; total as usize];
        // Ranges to ask for again: a peer with a smaller frame limit than ours sends
        // less than asked, and the rest is fetched with further requests.
        let mut again = Vec::new();
        place(&mut out, first, &mut again, from)?;
        let mut next = chunk.min(total);
        let mut in_flight = FuturesUnordered::new();
        loop {
            while in_flight.len() < self.fetch_window {
                let (offset, len) = match again.pop() {
                    Some(range) => range,
                    None if next < total => {
                        let len = chunk.min(total - next);
                        next += len;
                        (next - len, len)
                    }
                    None => break,
                };
                in_flight.push(self.blob_chunk(from, id, offset, len));
            }
            let Some(piece) = in_flight.next().await else {
                break;
            };
            place(&mut out, piece?, &mut again, from)?;
        }
        Ok(out)
    }

    async fn blob_chunk(&self, from: PeerId, id: BlobId, offset: u64, len: u64) -> Result<Piece> {
        let request = MeshRequest::BlobChunk {
            id,
            offset,
            len: len as u32,
        };
        let peer = from.to_string();
        match self.request(from, request).await? {
            MeshResponse::BlobChunk { total, data } => Ok(Piece {
                id,
                offset,
                asked: len,
                total,
                data,
            }),
            MeshResponse::NotFound => Err(NodeError::BlobNotFound { id, peer }),
            MeshResponse::Error(reason) => Err(NodeError::PeerRefused { peer, reason }),
            other => Err(NodeError::Request {
                peer,
                reason: format!("unexpected answer to a blob chunk request: {other:?}"),
            }),
        }
    }

    /// Peers with at least one open connection.
    pub async fn connected_peers(&self) -> Result<Vec<PeerId>> {
        let (reply, rx) = oneshot::channel();
        self.command(Command::ConnectedPeers(reply)).await?;
        rx.await.map_err(|_| NodeError::NetStopped)
    }

    /// Remembers an address of `peer` for later dials (e.g. from the membership table).
    /// Fault injection: closes every connection to `peer` and refuses new ones in
    /// both directions until [`NetHandle::mend`], as a network partition would.
    pub async fn cut(&self, peer: PeerId) -> Result<()> {
        self.command(Command::Cut { peer, cut: true }).await
    }

    /// Undoes [`NetHandle::cut`]: connections to `peer` are allowed again.
    pub async fn mend(&self, peer: PeerId) -> Result<()> {
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

/// One answered chunk request.
struct Piece {
    id: BlobId,
    offset: u64,
    asked: u64,
    total: u64,
    data: Vec<u8>,
}

/// Copies a chunk into the blob being assembled after checking that it fits what was
/// asked; a short (non-empty) chunk queues the rest in `again`.
fn place(out: &mut [u8], piece: Piece, again: &mut Vec<(u64, u64)>, from: PeerId) -> Result<()> {
    let total = out.len() as u64;
    let expect = piece.asked.min(total.saturating_sub(piece.offset));
    let got = piece.data.len() as u64;
    if piece.total != total || got > expect || (got == 0 && expect > 0) {
        return Err(NodeError::Request {
            peer: from.to_string(),
            reason: format!(
                "blob {}: chunk at {} has {got} bytes of a {}-byte blob, expected {expect} \
                 bytes of a {total}-byte blob (did the blob change?)",
                piece.id, piece.offset, piece.total
            ),
        });
    }
    let start = piece.offset as usize;
    out[start..start + piece.data.len()].copy_from_slice(&piece.data);
    if got < expect {
        again.push((piece.offset + got, expect - got));
    }
    Ok(())
}

// Admission comes first: a connection the allow-list or the caps refuse is denied
// before any other behaviour sets up a handler for it.
#[derive(NetworkBehaviour)]
struct MeshBehaviour {
    allow: Toggle<allow_block_list::Behaviour<allow_block_list::AllowedPeers>>,
    cut: allow_block_list::Behaviour<allow_block_list::BlockedPeers>,
    caps: connection_limits::Behaviour,
    rpc: request_response::Behaviour<codec::MeshCodec>,
    raft: libp2p_stream::Behaviour,
    identify: identify::Behaviour,
    mdns: Toggle<mdns::tokio::Behaviour>,
}

/// TCP, then the cluster key if there is one (so a stranger fails before Noise even
/// starts), then Noise for peer authentication, then Yamux for streams.
fn build_transport(
    keypair: &Keypair,
    psk: Option<PreSharedKey>,
) -> std::result::Result<Boxed<(PeerId, StreamMuxerBox)>, Box<dyn std::error::Error + Send + Sync>>
{
    // nodelay: request-response is latency-bound for Raft; Nagle would hold frames.
    let tcp = tcp::tokio::Transport::new(tcp::Config::default().nodelay(true));
    let guarded = tcp.and_then(move |socket, _| async move {
        match psk {
            Some(psk) => PnetConfig::new(psk)
                .handshake(socket)
                .await
                .map(futures::future::Either::Left),
            None => Ok(futures::future::Either::Right(socket)),
        }
    });
    Ok(guarded
        .upgrade(Version::V1Lazy)
        .authenticate(noise::Config::new(keypair)?)
        .multiplex(yamux::Config::default())
        .map(|(peer, muxer), _| (peer, StreamMuxerBox::new(muxer)))
        .boxed())
}

fn build_swarm(config: &NetConfig) -> Result<Swarm<MeshBehaviour>> {
    let setup = |e: &dyn fmt::Display| NodeError::NetSetup(e.to_string());
    let psk = config.psk;
    let rpc_config = request_response::Config::default()
        .with_request_timeout(config.request_timeout)
        // Pipelined blob chunks plus forwarded calls.
        .with_max_concurrent_streams(256);
    let codec = codec::MeshCodec::new(config.max_frame_bytes).counted_in(config.metrics.clone());
    let want_mdns = config.mdns;
    let allow = (!config.allow_peers.is_empty()).then(|| {
        let mut allow = allow_block_list::Behaviour::<allow_block_list::AllowedPeers>::default();
        for peer in &config.allow_peers {
            allow.allow_peer(*peer);
        }
        allow
    });
    let caps = config.connections.limits();
    let swarm = SwarmBuilder::with_existing_identity(config.keypair.clone())
        .with_tokio()
        .with_other_transport(|key| build_transport(key, psk))
        .map_err(|e| setup(&e))?
        .with_behaviour(|key| {
            let peer_id = key.public().to_peer_id();
            let mdns = if want_mdns {
                match mdns::tokio::Behaviour::new(mdns::Config::default(), peer_id) {
                    Ok(mdns) => Some(mdns),
                    Err(e) => {
                        tracing::warn!(
                            "mDNS could not start ({e}); peers must be given with --peer"
                        );
                        None
                    }
                }
            } else {
                None
            };
            MeshBehaviour {
                allow: Toggle::from(allow),
                cut: allow_block_list::Behaviour::default(),
                caps: connection_limits::Behaviour::new(caps),
                rpc: request_response::Behaviour::with_codec(
                    codec,
                    [(MESH_PROTOCOL, ProtocolSupport::Full)],
                    rpc_config,
                ),
                raft: libp2p_stream::Behaviour::new(),
                identify: identify::Behaviour::new(
                    identify::Config::new(IDENTIFY_PROTOCOL.into(), key.public())
                        .with_agent_version(format!("gpumesh/{}", env!("CARGO_PKG_VERSION"))),
                ),
                mdns: Toggle::from(mdns),
            }
        })
        .map_err(|e| setup(&e))?
        .with_swarm_config(|c| c.with_idle_connection_timeout(config.idle_timeout))
        // A little longer than the handle waits, so that a caller of `dial` gets the
        // clearer "did not complete within" error rather than the transport's.
        .with_connection_timeout(config.dial_timeout + Duration::from_secs(1))
        .build();
    Ok(swarm)
}

/// Starts every listener and waits until each reports its bound address, so a port 0
/// has become a real port before anyone asks.
async fn listen(swarm: &mut Swarm<MeshBehaviour>, addrs: &[Multiaddr]) -> Result<()> {
    let mut waiting: Vec<(ListenerId, Multiaddr)> = Vec::new();
    for addr in addrs {
        let id = swarm
            .listen_on(addr.clone())
            .map_err(|e| NodeError::NetSetup(format!("listen on {addr}: {e}")))?;
        waiting.push((id, addr.clone()));
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !waiting.is_empty() {
        let event = tokio::time::timeout_at(deadline, swarm.select_next_some())
            .await
            .map_err(|_| {
                NodeError::NetSetup(format!("listeners did not start within 10s: {waiting:?}"))
            })?;
        match event {
            SwarmEvent::NewListenAddr {
                listener_id,
                address,
            } => {
                tracing::info!(%address, "listening");
                waiting.retain(|(id, _)| *id != listener_id);
            }
            SwarmEvent::ListenerClosed {
                listener_id,
                reason,
                ..
            } => {
                let addr = waiting.iter().find(|(id, _)| *id == listener_id);
                return Err(NodeError::NetSetup(format!(
                    "listener {addr:?} closed: {reason:?}"
                )));
            }
            SwarmEvent::ListenerError { listener_id, error } => {
                let addr = waiting.iter().find(|(id, _)| *id == listener_id);
                return Err(NodeError::NetSetup(format!("listener {addr:?}: {error}")));
            }
            other => tracing::debug!(?other, "swarm event while starting"),
        }
    }
    Ok(())
}

/// The peer id at the end of `/…/p2p/<id>`, if any.
fn peer_of(addr: &Multiaddr) -> Option<PeerId> {
    match addr.iter().last() {
        Some(Protocol::P2p(peer)) => Some(peer),
        _ => None,
    }
}

/// Why a dial failed, in words, without repeating the address the caller named.
fn dial_reason(error: &DialError) -> String {
    match error {
        DialError::Transport(errors) => {
            let mut reasons: Vec<String> = Vec::new();
            for (_, e) in errors {
                // The innermost cause ("Connection refused") is the useful part.
                let mut cause: &dyn std::error::Error = e;
                while let Some(inner) = cause.source() {
                    cause = inner;
                }
                let text = cause.to_string();
                if !reasons.contains(&text) {
                    reasons.push(text);
                }
            }
            reasons.join("; ")
        }
        DialError::WrongPeerId { obtained, .. } => {
            format!("the node there is {obtained}, not the peer id in the address")
        }
        DialError::Denied { cause } => denial(cause),
        other => other.to_string(),
    }
}

/// Why this node's admission refused a connection, naming the setting involved.
fn denial(cause: &ConnectionDenied) -> String {
    if let Some(not_allowed) = cause.downcast_ref::<allow_block_list::NotAllowed>() {
        format!("{not_allowed} of this node (--allow-peer)")
    } else if let Some(exceeded) = cause.downcast_ref::<connection_limits::Exceeded>() {
        format!(
            "{exceeded} (--max-connections-per-peer, --max-connections, --max-pending-incoming)"
        )
    } else {
        format!("refused by this node: {cause}")
    }
}

struct PendingDial {
    addr: Multiaddr,
    reply: Option<oneshot::Sender<Result<PeerId>>>,
    bootstrap: Option<usize>,
}

enum PendingRequest {
    Reply(oneshot::Sender<Result<MeshResponse>>),
}

/// A `--peer` address the node keeps trying to be connected to.
struct Bootstrap {
    addr: Multiaddr,
    peer: Option<PeerId>,
    dialing: Option<ConnectionId>,
    failures: u32,
    next_try: Instant,
}

type Reply = (ResponseChannel<MeshResponse>, MeshResponse);

// One lives on the stack for one loop turn; boxing a variant would only add an
// allocation per event.
#[allow(clippy::large_enum_variant)]
enum Wake {
    Reply(Reply),
    Command(Command),
    Swarm(SwarmEvent<MeshBehaviourEvent>),
    Redial,
}

struct NetActor {
    swarm: Swarm<MeshBehaviour>,
    commands: mpsc::Receiver<Command>,
    events: mpsc::Sender<NetEvent>,
    /// Events the node has not had room for yet, in order.
    outbox: VecDeque<NetEvent>,
    replies_tx: mpsc::Sender<Reply>,
    replies: mpsc::Receiver<Reply>,
    blobs: BlobStore,
    pending_requests: HashMap<OutboundRequestId, PendingRequest>,
    pending_dials: HashMap<ConnectionId, PendingDial>,
    bootstrap: Vec<Bootstrap>,
    node_answer_timeout: Duration,
    max_chunk: u32,
    redial_interval: Duration,
    metrics: NetMetrics,
}

impl NetActor {
    async fn run(mut self, cancel: CancellationToken) {
        let mut redial = tokio::time::interval(self.redial_interval.min(Duration::from_secs(1)));
        redial.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            // The branches only pick what to do: their futures borrow the actor's
            // fields until the select ends, so the handling happens after it.
            let wake = tokio::select! {
                biased;
                _ = cancel.cancelled() => break,
                // Answers first: each one finishes a stream a peer is waiting on.
                Some(reply) = self.replies.recv() => Wake::Reply(reply),
                permit = self.events.reserve(), if !self.outbox.is_empty() => {
                    match permit {
                        Ok(permit) => {
                            if let Some(event) = self.outbox.pop_front() {
                                permit.send(event);
                            }
                        }
                        Err(_) => self.outbox.clear(),
                    }
                    continue;
                }
                command = self.commands.recv() => match command {
                    Some(command) => Wake::Command(command),
                    None => break,
                },
                event = self.swarm.select_next_some() => Wake::Swarm(event),
                _ = redial.tick() => Wake::Redial,
            };
            match wake {
                Wake::Reply((channel, response)) => self.respond(channel, response),
                Wake::Command(command) => self.on_command(command),
                Wake::Swarm(event) => self.on_swarm_event(event),
                Wake::Redial => self.redial(),
            }
        }
        tracing::debug!(peer = %self.swarm.local_peer_id(), "net actor stopped");
    }

    /// Hands an event to the node without ever waiting for it; returns whether the
    /// event was kept (dropped only when the node is gone or far behind).
    fn emit(&mut self, event: NetEvent) -> bool {
        if self.events.is_closed() {
            return false;
        }
        if self.outbox.is_empty() {
            match self.events.try_send(event) {
                Ok(()) => return true,
                Err(mpsc::error::TrySendError::Closed(_)) => return false,
                Err(mpsc::error::TrySendError::Full(event)) => {
                    self.outbox.push_back(event);
                    return true;
                }
            }
        }
        if self.outbox.len() >= OUTBOX_LIMIT {
            tracing::warn!(?event, "the node is not taking network events; dropped one");
            return false;
        }
        self.outbox.push_back(event);
        true
    }

    fn respond(&mut self, channel: ResponseChannel<MeshResponse>, response: MeshResponse) {
        if let Err(response) = self
            .swarm
            .behaviour_mut()
            .rpc
            .send_response(channel, response)
        {
            tracing::debug!(?response, "peer went away before its answer was ready");
        }
    }

    fn on_command(&mut self, command: Command) {
        match command {
            Command::ListenAddrs(reply) => {
                let _ = reply.send(self.swarm.listeners().cloned().collect());
            }
            Command::Dial { addr, reply } => self.dial(addr, Some(reply), None),
            Command::Request { to, request, reply } => {
                let id = self.swarm.behaviour_mut().rpc.send_request(&to, request);
                self.pending_requests
                    .insert(id, PendingRequest::Reply(reply));
            }
            Command::ConnectedPeers(reply) => {
                let _ = reply.send(self.swarm.connected_peers().copied().collect());
            }
            Command::AddAddress { peer, addr } => self.swarm.add_peer_address(peer, addr),
            Command::Cut { peer, cut: true } => {
                tracing::warn!(%peer, "fault injection: cutting every connection to the peer");
                self.swarm.behaviour_mut().cut.block_peer(peer);
            }
            Command::Cut { peer, cut: false } => {
                tracing::warn!(%peer, "fault injection: connections to the peer allowed again");
                self.swarm.behaviour_mut().cut.unblock_peer(peer);
            }
        }
    }

    fn dial(
        &mut self,
        addr: Multiaddr,
        reply: Option<oneshot::Sender<Result<PeerId>>>,
        bootstrap: Option<usize>,
    ) {
        let opts = match peer_of(&addr) {
            Some(peer) if self.swarm.is_connected(&peer) => {
                if let Some(reply) = reply {
                    let _ = reply.send(Ok(peer));
                }
                return;
            }
            Some(peer) => DialOpts::peer_id(peer)
                .addresses(vec![addr.clone()])
                // An explicit dial is answered by its own connection, even if another
                // dial to the peer is already under way.
                .condition(PeerCondition::Always)
                .build(),
            None => DialOpts::unknown_peer_id().address(addr.clone()).build(),
        };
        let connection = opts.connection_id();
        match self.swarm.dial(opts) {
            Ok(()) => {
                if let Some(index) = bootstrap {
                    self.bootstrap[index].dialing = Some(connection);
                }
                self.pending_dials.insert(
                    connection,
                    PendingDial {
                        addr,
                        reply,
                        bootstrap,
                    },
                );
            }
            Err(e) => {
                let error = NodeError::Dial {
                    addr: addr.to_string(),
                    reason: dial_reason(&e),
                };
                match reply {
                    Some(reply) => {
                        let _ = reply.send(Err(error));
                    }
                    None => tracing::warn!("{error}"),
                }
            }
        }
    }

    /// Dials every bootstrap peer that is neither connected nor being dialled, once
    /// its backoff has passed.
    fn redial(&mut self) {
        let now = Instant::now();
        for index in 0..self.bootstrap.len() {
            let entry = &self.bootstrap[index];
            let connected = entry.peer.is_some_and(|p| self.swarm.is_connected(&p));
            if connected || entry.dialing.is_some() || entry.next_try > now {
                continue;
            }
            let addr = entry.addr.clone();
            self.dial(addr, None, Some(index));
        }
    }

    fn on_swarm_event(&mut self, event: SwarmEvent<MeshBehaviourEvent>) {
        match event {
            SwarmEvent::Behaviour(MeshBehaviourEvent::Rpc(event)) => self.on_rpc(event),
            SwarmEvent::Behaviour(MeshBehaviourEvent::Identify(identify::Event::Received {
                peer_id,
                info,
                ..
            })) => {
                if info.protocol_version != IDENTIFY_PROTOCOL {
                    tracing::debug!(%peer_id, version = %info.protocol_version, "not a gpumesh peer");
                    return;
                }
                let addrs: Vec<Multiaddr> = info
                    .listen_addrs
                    .into_iter()
                    .filter(|a| !is_unspecified(a))
                    .collect();
                for addr in &addrs {
                    self.swarm.add_peer_address(peer_id, addr.clone());
                }
                self.emit(NetEvent::PeerDiscovered {
                    peer: peer_id,
                    addrs,
                });
            }
            SwarmEvent::Behaviour(MeshBehaviourEvent::Identify(_)) => {}
            SwarmEvent::Behaviour(MeshBehaviourEvent::Mdns(mdns::Event::Discovered(found))) => {
                let mut by_peer: HashMap<PeerId, Vec<Multiaddr>> = HashMap::new();
                for (peer, addr) in found {
                    self.swarm.add_peer_address(peer, addr.clone());
                    by_peer.entry(peer).or_default().push(addr);
                }
                for (peer, addrs) in by_peer {
                    tracing::debug!(%peer, ?addrs, "found by mDNS");
                    self.emit(NetEvent::PeerDiscovered { peer, addrs });
                }
            }
            SwarmEvent::Behaviour(MeshBehaviourEvent::Mdns(mdns::Event::Expired(_))) => {}
            SwarmEvent::ConnectionEstablished {
                peer_id,
                connection_id,
                endpoint,
                num_established,
                ..
            } => {
                let remote = endpoint.get_remote_address().clone();
                if endpoint.is_dialer() {
                    // Remember what worked, so request-response can redial it.
                    self.swarm.add_peer_address(peer_id, remote.clone());
                }
                if let Some(dial) = self.pending_dials.remove(&connection_id) {
                    if let Some(index) = dial.bootstrap {
                        let entry = &mut self.bootstrap[index];
                        entry.peer = Some(peer_id);
                        entry.dialing = None;
                        entry.failures = 0;
                    }
                    if let Some(reply) = dial.reply {
                        let _ = reply.send(Ok(peer_id));
                    }
                }
                if num_established.get() == 1 {
                    self.metrics
                        .set_connected_peers(self.swarm.connected_peers().count());
                    tracing::info!(peer = %peer_id, addr = %remote, "connected");
                    self.emit(NetEvent::PeerConnected {
                        peer: peer_id,
                        addr: remote,
                    });
                }
            }
            SwarmEvent::ConnectionClosed {
                peer_id,
                num_established: 0,
                cause,
                ..
            } => {
                self.metrics
                    .set_connected_peers(self.swarm.connected_peers().count());
                tracing::info!(peer = %peer_id, ?cause, "disconnected");
                self.emit(NetEvent::PeerDisconnected(peer_id));
            }
            SwarmEvent::OutgoingConnectionError {
                connection_id,
                peer_id,
                error,
            } => {
                let Some(dial) = self.pending_dials.remove(&connection_id) else {
                    tracing::debug!(?peer_id, "dial failed: {error}");
                    return;
                };
                let error = NodeError::Dial {
                    addr: dial.addr.to_string(),
                    reason: dial_reason(&error),
                };
                if let Some(index) = dial.bootstrap {
                    let entry = &mut self.bootstrap[index];
                    entry.dialing = None;
                    entry.failures += 1;
                    let backoff = self.redial_interval * 2u32.pow(entry.failures.min(6));
                    entry.next_try = Instant::now() + backoff.min(MAX_REDIAL_BACKOFF);
                    if entry.failures == 1 {
                        tracing::warn!("bootstrap peer: {error}; retrying in the background");
                    } else {
                        tracing::debug!(failures = entry.failures, "bootstrap peer: {error}");
                    }
                }
                if let Some(reply) = dial.reply {
                    let _ = reply.send(Err(error));
                }
            }
            SwarmEvent::IncomingConnectionError {
                send_back_addr,
                error,
                peer_id,
                ..
            } => {
                // Strangers, port scanners, nodes with another cluster key, peers off
                // the allow-list or over a connection limit.
                let reason = match &error {
                    ListenError::Denied { cause } => denial(cause),
                    other => other.to_string(),
                };
                match peer_id {
                    Some(peer) => tracing::info!(
                        from = %send_back_addr, %peer, "refused an incoming connection: {reason}"
                    ),
                    None => tracing::info!(
                        from = %send_back_addr, "refused an incoming connection: {reason}"
                    ),
                }
            }
            SwarmEvent::NewListenAddr { address, .. } => {
                tracing::info!(%address, "listening");
            }
            SwarmEvent::ListenerError { error, .. } => {
                tracing::warn!("listener error: {error}");
            }
            _ => {}
        }
    }

    fn on_rpc(&mut self, event: request_response::Event<MeshRequest, MeshResponse>) {
        use request_response::{Event, InboundFailure, Message};
        match event {
            Event::Message {
                peer,
                message:
                    Message::Request {
                        request, channel, ..
                    },
                ..
            } => self.on_request(peer, request, channel),
            Event::Message {
                message:
                    Message::Response {
                        request_id,
                        response,
                    },
                ..
            } => match self.pending_requests.remove(&request_id) {
                Some(PendingRequest::Reply(reply)) => {
                    let _ = reply.send(Ok(response));
                }
                None => {}
            },
            Event::OutboundFailure {
                peer,
                request_id,
                error,
                ..
            } => match self.pending_requests.remove(&request_id) {
                Some(PendingRequest::Reply(reply)) => {
                    let _ = reply.send(Err(NodeError::Request {
                        peer: peer.to_string(),
                        reason: error.to_string(),
                    }));
                }
                None => {}
            },
            Event::InboundFailure { peer, error, .. } => match error {
                InboundFailure::Io(e) => {
                    tracing::warn!(%peer, "bad request from peer dropped: {e}");
                }
                other => tracing::debug!(%peer, "inbound request failed: {other}"),
            },
            Event::ResponseSent { .. } => {}
        }
    }

    fn on_request(
        &mut self,
        from: PeerId,
        request: MeshRequest,
        channel: ResponseChannel<MeshResponse>,
    ) {
        match request {
            MeshRequest::BlobChunk { id, offset, len } => {
                let blobs = self.blobs.clone();
                let replies = self.replies_tx.clone();
                let len = u64::from(len.min(self.max_chunk));
                // Disk reads stay off the actor; the answer comes back through
                // `replies` because only the actor may touch the swarm.
                tokio::spawn(async move {
                    let read =
                        tokio::task::spawn_blocking(move || blobs.read_range(&id, offset, len))
                            .await;
                    let response = match read {
                        Ok(Ok(Some((total, data)))) => MeshResponse::BlobChunk { total, data },
                        Ok(Ok(None)) => MeshResponse::NotFound,
                        Ok(Err(e)) => {
                            tracing::warn!(%from, "serving blob {id}: {e}");
                            MeshResponse::Error(format!("could not read blob {id}: {e}"))
                        }
                        Err(e) => MeshResponse::Error(format!("blob read failed: {e}")),
                    };
                    let _ = replies.send((channel, response)).await;
                });
            }
            request @ MeshRequest::Node(_) => {
                let (reply, answer) = oneshot::channel();
                let kind = request.kind();
                self.emit(NetEvent::Request {
                    from,
                    request,
                    reply,
                });
                let replies = self.replies_tx.clone();
                let timeout = self.node_answer_timeout;
                tokio::spawn(async move {
                    let response = match tokio::time::timeout(timeout, answer).await {
                        Ok(Ok(response)) => response,
                        Ok(Err(_)) => MeshResponse::Error(format!(
                            "the node did not handle the {kind} request"
                        )),
                        Err(_) => MeshResponse::Error(format!(
                            "the node did not answer the {kind} request within {:.1}s",
                            timeout.as_secs_f64()
                        )),
                    };
                    let _ = replies.send((channel, response)).await;
                });
            }
        }
    }
}

fn is_unspecified(addr: &Multiaddr) -> bool {
    addr.iter().any(|p| match p {
        Protocol::Ip4(ip) => ip.is_unspecified(),
        Protocol::Ip6(ip) => ip.is_unspecified(),
        _ => false,
    })
}
